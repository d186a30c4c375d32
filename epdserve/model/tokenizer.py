"""Tokenizer and chat template, from the same Hugging Face directory as the weights (or a
template given on the command line, vLLM's ``--chat-template``)."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=4)
def load_tokenizer(model_dir: str | Path, chat_template: str | None = None):
    """Load the tokenizer (a ``transformers`` fast tokenizer) of a resolved model directory
    (see :func:`epdserve.model.loader.resolve_model`); ``chat_template`` (Jinja source, see
    :func:`read_chat_template`) replaces the model's own template. Cached per argument pair,
    so a template given here never changes another caller's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def read_chat_template(value: str) -> str:
    """The Jinja source ``--chat-template`` names: a file's text, or, as vLLM takes it, the
    template itself when ``value`` is no file but holds a Jinja tag.

    Raises:
        ValueError: no such file (and no template), or the file cannot be read as UTF-8.
    """
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
    """Render one user message with the tokenizer's template, so that a broken template
    fails at startup, not on every request.

    Raises:
        ValueError: the template is missing, does not compile or fails on that message.
    """
    chat_prompt_text(tokenizer, [{"role": "user", "content": "hello"}])


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template has a tool format: its source uses a ``tools`` variable
    (the one ``apply_chat_template(tools=...)`` sets). A template that never mentions it
    (SmolLM2's) would drop the tools silently. A template set keyed by name uses its
    ``tool_use`` entry for tools, as transformers picks it."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return bool(template) and re.search(r"\btools\b", template) is not None


def chat_prompt_text(tokenizer, messages: list[dict], **template) -> str:
    """``messages`` rendered with the model's chat template, by default with the generation
    prompt; ``template``: more arguments of ``apply_chat_template`` (e.g. ``tools``: OpenAI's
    tool JSON, as transformers passes them; ``add_generation_prompt``,
    ``continue_final_message``) and variables for the template.

    Raises:
        ValueError: the template cannot render these messages.
    """
    template.setdefault("add_generation_prompt", True)
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **template)
    except Exception as exc:  # jinja2 raises TemplateError and friends
        raise ValueError(f"chat template failed: {exc}") from None


def chat_prompt_ids(tokenizer, messages: list[dict], add_special_tokens: bool = False, **template) -> list[int]:
    """Token ids of :func:`chat_prompt_text`. By default special tokens come from the
    template only (vLLM's convention for chat requests, its ``add_special_tokens`` false),
    so no extra BOS is added.

    Raises:
        ValueError: the template cannot render these messages.
    """
    return tokenizer(chat_prompt_text(tokenizer, messages, **template), add_special_tokens=add_special_tokens).input_ids
