"""The text ``add_generation_prompt=False`` renders, derived exactly from the ``True`` render, where the template
proves it: one chat-template render per prompt instead of two.

``render._render_texts`` needs both texts of a record: the prompt (``add_generation_prompt=True``) and the same
conversation without the generation prompt, which gives the ``missing_generation_prompt`` verdict and the
``generation_prompt`` / ``generation_prompt_tokens`` / ``ends_with_think_start`` / ``ids_after_think_start`` flags
(the ids that the generation prompt wrote). Rendering is most of the ``tokenized_prompts`` stage's time, so the
second render is derived instead when the template's syntax tree (``jinja2.Environment.parse``, with the
environment transformers compiles chat templates in) proves that, for EVERY conversation,

    render(add_generation_prompt=True) == P + G + T   and   render(add_generation_prompt=False) == P + T

with ``G`` and ``T`` the same text for every conversation under one tokenizer and one set of template kwargs
(``enable_thinking``). ``prove_constant_suffix`` accepts a template only when

1. it neither extends, includes nor imports another template (so its top level is its output order);
2. exactly one top-level ``{% if add_generation_prompt %}`` (the bare name as its whole test, no ``elif``/``else``)
   holds every reference to ``add_generation_prompt`` in the template: everything before it renders the same
   text ``P`` (and raises the same errors) under both values, because nothing else can read the variable;
3. only literal text follows that block at the top level: ``T`` (usually empty);
4. the block's body is made of literal output, ``if``, boolean operators, comparisons and tests (``is defined``,
   ``is false``, ...) over literals and over names that the template never assigns and that are not the
   conversation's inputs (``messages``, ``tools``, ``documents``): template kwargs such as ``enable_thinking``,
   the special-token strings, undefined names. No calls, filters, attribute or item access. Its output ``G`` is
   then a function of the tokenizer and the kwargs alone (an error in it is raised by the ``True`` render, which
   is always made, and the ``False`` render never runs it).

Qwen3's template (``G`` = ``<|im_start|>assistant\\n``, plus ``<think>\\n\\n</think>\\n\\n`` with
``enable_thinking=False``: one ``G`` per kwargs), Kimi-K2-Thinking / K2.5 and the demo target's template pass;
DeepSeek-V3's does not (``{% if add_generation_prompt and not ns.is_tool %}``: no header after tool outputs, so
``G`` depends on the conversation) and keeps two renders, as does any template that fails a rule above.
``G + T`` and ``T`` are then read off a probe conversation rendered both ways, once per tokenizer template,
special tokens and kwargs (``constant_suffix``, cached). The derivation is exact by the proof; ``derive_plain``
still checks that a prompt ends with ``G + T`` and answers None (render it) otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

# The conversation's own inputs in transformers' ``render_jinja_template`` (they differ between records).
RECORD_VARIABLES = frozenset({"messages", "tools", "documents"})
# Names that Jinja binds by scope (never the template context's values).
_SCOPED_NAMES = frozenset({"loop", "self", "caller", "varargs", "kwargs", "super"})
# Builtin Jinja tests: pure functions of their operands.
_PURE_TESTS = frozenset({"defined", "undefined", "none", "true", "false", "boolean", "string", "number", "integer",
                         "float", "sameas", "eq", "equalto", "==", "ne", "!=", "lt", "le", "gt", "ge", "in",
                         "odd", "even", "lower", "upper"})
_MAX_CACHED = 64


@dataclass(frozen=True)
class ConstantSuffix:
    """A proven split of every render: the prompt ends with ``generation_tail`` (``G + T``), and the render without
    the generation prompt is the prompt minus that tail plus ``plain_tail`` (``T``). Texts, not ids."""

    generation_tail: str
    plain_tail: str

    def derive_plain(self, text: str) -> str | None:
        """The ``add_generation_prompt=False`` render of the conversation whose ``True`` render is ``text``, or
        None when ``text`` does not end with ``generation_tail`` (not reached under the proof; render it then)."""
        if not text.endswith(self.generation_tail):
            return None
        return text[:len(text) - len(self.generation_tail)] + self.plain_tail


def _descendants(node: Any) -> Iterator[Any]:
    from jinja2 import nodes

    yield node
    yield from node.find_all(nodes.Node)


def prove_constant_suffix(env: Any, source: str) -> tuple[str, ...] | None:
    """Check rules 1-4 of the module docstring on ``source`` parsed by ``env`` (the jinja2 environment the
    template is compiled in). Returns the literal texts that follow the generation block (rule 3; their
    concatenation is ``T``) when every rule holds, else None. Raises nothing (a template that does not parse is
    None)."""
    from jinja2 import nodes

    try:
        tree = env.parse(source)
    except Exception:
        return None
    if any(True for _ in tree.find_all((nodes.Extends, nodes.Include, nodes.Import, nodes.FromImport))):
        return None
    top = tree.body
    blocks = [i for i, n in enumerate(top) if isinstance(n, nodes.If) and isinstance(n.test, nodes.Name)
              and n.test.name == "add_generation_prompt"]
    if len(blocks) != 1:
        return None
    block = top[blocks[0]]
    if block.elif_ or block.else_:
        return None
    trailing: list[str] = []
    for node in top[blocks[0] + 1:]:
        if not isinstance(node, nodes.Output) or not all(isinstance(c, nodes.TemplateData) for c in node.nodes):
            return None
        trailing.extend(c.data for c in node.nodes)
    inside = {id(n) for part in block.body for n in _descendants(part)} | {id(block.test)}
    names = list(tree.find_all(nodes.Name))
    if any(n.name == "add_generation_prompt" and id(n) not in inside for n in names):
        return None
    assigned = {n.name for n in names if n.ctx != "load"}
    pure = (nodes.Output, nodes.TemplateData, nodes.Const, nodes.If, nodes.And, nodes.Or, nodes.Not, nodes.Test,
            nodes.Compare, nodes.Operand, nodes.Name, nodes.Concat, nodes.CondExpr)
    for part in block.body:
        for n in _descendants(part):
            if type(n) not in pure:
                return None
            if isinstance(n, nodes.Test) and (n.name not in _PURE_TESTS or n.dyn_args or n.dyn_kwargs):
                return None
            if isinstance(n, nodes.Name) and (n.ctx != "load" or n.name in assigned or n.name in RECORD_VARIABLES
                                              or n.name in _SCOPED_NAMES):
                return None
    return tuple(trailing)


# Probe conversations: the first one the template renders both ways gives G + T and T.
_PROBES = (
    [{"role": "user", "content": "Hello."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."}],
)
_CACHE: dict[tuple, ConstantSuffix | None] = {}


def constant_suffix(tokenizer: Any, kwargs: dict[str, Any]) -> ConstantSuffix | None:
    """The proven ``ConstantSuffix`` of the tokenizer's chat template under the template ``kwargs`` (e.g.
    ``{"enable_thinking": False}``), or None: two renders are needed (no template, a dict of named templates, a
    template that fails ``prove_constant_suffix``, a probe that does not render or does not split as proven).
    Cached per template source, special tokens and kwargs; raises nothing."""
    from eagle_assets.target_model.template_sandbox import compiled_templates

    source = getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str) or not source:
        return None
    try:
        key = (source, json.dumps(kwargs, sort_keys=True, default=repr),
               json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=repr))
    except (TypeError, ValueError):
        return None
    if key in _CACHE:
        return _CACHE[key]
    found = None
    compiled = compiled_templates(tokenizer)
    trailing = prove_constant_suffix(compiled[0].environment, source) if compiled else None
    if trailing is not None:
        plain_tail = "".join(trailing)
        for probe in _PROBES:
            try:
                with_gen = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False, **kwargs)
                plain = tokenizer.apply_chat_template(probe, add_generation_prompt=False, tokenize=False, **kwargs)
            except Exception:
                continue
            if not (isinstance(with_gen, str) and isinstance(plain, str) and plain.endswith(plain_tail)):
                break
            head = plain[:len(plain) - len(plain_tail)]
            if with_gen.startswith(head) and with_gen.endswith(plain_tail) and len(with_gen) > len(plain):
                found = ConstantSuffix(with_gen[len(head):], plain_tail)
            break
    if len(_CACHE) >= _MAX_CACHED:
        _CACHE.clear()
    _CACHE[key] = found
    return found
