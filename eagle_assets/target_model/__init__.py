"""The target model's side of the pipeline: tokenizer loading, family profile (marker and stop ids), and prompt
rendering.

Public API::

    load_tokenizer(path_or_name) -> tokenizer
    load_kimi_tokenizer(dir, chat_template_path=None) -> PreTrainedTokenizerFast
    detect_profile(tokenizer, overrides=None) -> FamilyProfile
    render_prompt(tokenizer, messages, tools, enable_thinking=None, max_prompt_tokens=None, profile=None)
        -> RenderedPrompt; raises RenderError(reason, detail)
"""

from eagle_assets.target_model.kimi import load_kimi_tokenizer
from eagle_assets.target_model.profile import FamilyProfile, ProfileError, detect_profile
from eagle_assets.target_model.render import RENDER_REASONS, RenderedPrompt, RenderError, render_prompt, template_hash
from eagle_assets.target_model.tokenizer import TokenizerLoadError, load_tokenizer

__all__ = [
    "RENDER_REASONS",
    "FamilyProfile",
    "ProfileError",
    "RenderError",
    "RenderedPrompt",
    "TokenizerLoadError",
    "detect_profile",
    "load_kimi_tokenizer",
    "load_tokenizer",
    "render_prompt",
    "template_hash",
]
