"""Faster attribute checks in the Jinja sandbox that renders chat templates, with the same verdicts.

transformers renders every chat template in a ``jinja2.sandbox.ImmutableSandboxedEnvironment`` (chat templates come
from model directories, so they are untrusted code). Every ``message.role`` / ``content.startswith`` in a template
goes through the sandbox's ``getattr``, which

- tries ``getattr(obj, name)`` first, so on a plain dict (every message) it raises and catches an AttributeError
  before falling back to ``obj[name]``;
- asks ``is_safe_attribute(obj, name, value)``, which walks ``isinstance`` checks against the internal types
  (functions, methods, frames, generators...) and the known mutable ABCs (list, dict, set, deque...).

Measured on Qwen3's template (``bench/bench_render.py --profile``), these checks were over half of a render's time.
``tune_sandbox`` sets two instance attributes on the environment of a compiled template, leaving the class and
every other environment alone:

- ``is_safe_attribute`` is memoized per ``(type(obj), name)``. In jinja2 3.1 the verdict is a function of exactly
  that: ``SandboxedEnvironment.is_safe_attribute`` ignores ``value`` and tests the name's prefix and
  ``is_internal_attribute(obj, name)``, which branches only on ``isinstance(obj, <type>)``;
  ``ImmutableSandboxedEnvironment`` adds ``modifies_known_mutable(obj, name)``, again ``isinstance`` checks and the
  name. ``isinstance(obj, T)`` is decided by ``type(obj)`` alone for these (none of them overrides
  ``__instancecheck__`` per instance). The first call for a key asks the class's own method, so a future jinja2
  that tightens the rules is still asked, once per key.
- ``getattr`` on an object whose type is exactly ``dict`` goes straight to ``obj[name]`` when ``dict`` has no
  attribute ``name``: a plain dict has no instance attributes, so ``getattr(obj, name)`` would raise exactly then,
  and the sandbox's own fallback is ``obj[name]`` (unchecked, as here) or ``undefined`` when the key is missing.
  Every other object takes the sandbox's own path.

A test compares the verdicts with the class's on safe and unsafe attributes, and the rendered texts with the
untuned environment's on every family and layout. When the environment is not the expected class, or a future
transformers no longer exposes the compiled template, nothing is changed and rendering is merely slower.
"""

from __future__ import annotations

from typing import Any

_TUNED = "_eagle_assets_tuned"
_DICT_ATTRIBUTES = frozenset(dir(dict))


def compiled_templates(tokenizer: Any) -> list[Any]:
    """The jinja2 ``Template`` objects transformers renders this tokenizer's chat template(s) with (its own
    ``lru_cache``d compile, so tuning them tunes every ``apply_chat_template`` call with that template in this
    process); [] when there is no template or transformers has no such cache."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return []
    template = getattr(tokenizer, "chat_template", None)
    sources = [template] if isinstance(template, str) else list(template.values()) if isinstance(template, dict) else []
    out = []
    for source in sources:
        if isinstance(source, str) and source:
            try:
                out.append(_compile_jinja_template(source))
            except Exception:  # a template that does not compile: apply_chat_template reports it per record
                continue
    return out


def tune_sandbox(tokenizer: Any) -> int:
    """Tune the sandbox of each of the tokenizer's compiled chat templates (idempotent); returns how many
    environments were tuned by this call."""
    tuned = 0
    for compiled in compiled_templates(tokenizer):
        if tune_environment(getattr(compiled, "environment", None)):
            tuned += 1
    return tuned


def tune_environment(env: Any) -> bool:
    """Memoize ``env.is_safe_attribute`` and shortcut ``env.getattr`` on plain dicts (see the module docstring);
    returns False, changing nothing, when ``env`` is not a jinja2 ``ImmutableSandboxedEnvironment`` or is already
    tuned."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(env, ImmutableSandboxedEnvironment) or getattr(env, _TUNED, False):
        return False
    cls = type(env)
    class_verdict = cls.is_safe_attribute
    class_getattr = cls.getattr
    verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = verdicts[key] = bool(class_verdict(env, obj, attr, value))
        return verdict

    def getattr_(obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return env.undefined(obj=obj, name=attribute)
        return class_getattr(env, obj, attribute)

    env.is_safe_attribute = is_safe_attribute
    env.getattr = getattr_
    setattr(env, _TUNED, True)
    return True
