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


def chat_prompt_text(tokenizer, messages: list[dict]) -> str:
    """``messages`` rendered with the model's chat template plus the generation prompt.

    Raises:
        ValueError: the template cannot render these messages.
    """
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja2 raises TemplateError and friends
        raise ValueError(f"chat template failed: {exc}") from None


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of :func:`chat_prompt_text`. Special tokens come from the template only
    (vLLM's convention for chat requests), so no extra BOS is added.

    Raises:
        ValueError: the template cannot render these messages.
    """
    return tokenizer(chat_prompt_text(tokenizer, messages), add_special_tokens=False).input_ids
