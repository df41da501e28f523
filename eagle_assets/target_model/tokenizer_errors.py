"""The error every tokenizer loader raises (the general one in ``tokenizer``, Kimi's in ``kimi``)."""


class TokenizerLoadError(RuntimeError):
    """The tokenizer cannot be loaded from local files; the message says what to provide."""
