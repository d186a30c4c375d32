"""Tokenizer and chat template, from the same Hugging Face directory as the weights (or a
template given on the command line, vLLM's ``--chat-template``)."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=4)
def load_tokenizer(model_dir: str | Path, chat_template: str | None = None):
    """``chat_template`` replaces the model's; cached per argument pair, so it never changes another caller's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def read_chat_template(value: str) -> str:
    """A file's text, or the value itself if it holds a Jinja tag (as vLLM). Raises ValueError."""
    path = Path(value)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value}: cannot read it: {exc}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value}: no such file (and not a Jinja template)")


def check_chat_template(tokenizer) -> None:
    """Fail at startup, not per request. Raises ValueError: missing, not compiling, or failing on one message."""
    chat_prompt_text(tokenizer, [{"role": "user", "content": "hello"}])


def template_renders_tools(tokenizer) -> bool:
    """Whether the template uses ``tools`` (SmolLM2's does not: tools would be dropped silently)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return bool(template) and re.search(r"\btools\b", template) is not None


def chat_prompt_text(tokenizer, messages: list[dict], **template) -> str:
    """``template``: more ``apply_chat_template`` arguments and variables. Raises ValueError if it cannot render."""
    template.setdefault("add_generation_prompt", True)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **template)
    except Exception as exc:  # jinja2 raises TemplateError and friends
        raise ValueError(f"chat template failed: {exc}") from None


def chat_prompt_ids(tokenizer, messages: list[dict], add_special_tokens: bool = False, **template) -> list[int]:
    """Special tokens from the template only by default (vLLM's chat convention: no extra BOS). Raises ValueError."""
    return tokenizer(chat_prompt_text(tokenizer, messages, **template), add_special_tokens=add_special_tokens).input_ids
