"""How many drafted tokens the target would accept: the walks SGLang's verification implies, per suite, thinking
mode and k, and the verdicts and reports built on them."""
