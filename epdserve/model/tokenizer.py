"""Tokenizer and chat template, from the same Hugging Face directory as the weights."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=4)
def load_tokenizer(model_dir: str | Path):
    """Load the tokenizer (a ``transformers`` fast tokenizer) of a resolved model directory
    (see :func:`epdserve.model.loader.resolve_model`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def chat_prompt_text(tokenizer, messages: list[dict], **template) -> str:
    """``messages`` rendered with the model's chat template, by default with the generation
    prompt; ``template``: more arguments of ``apply_chat_template`` (e.g.
    ``add_generation_prompt``, ``continue_final_message``) and variables for the template.

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
