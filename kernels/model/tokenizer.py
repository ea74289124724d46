"""Text <-> token ids with a model's Hugging Face tokenizer and chat template. No torch: the gateway
uses these without loading any model code."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # what a decode of an incomplete UTF-8 byte sequence ends with


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]] | str) -> list[int]:
    """Token ids of ``messages`` (or one user message ``str``) with the assistant prompt appended."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; use encode_prompt() for raw completions")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return encode_prompt(tokenizer, text)


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Plain encoding without adding special tokens (templates already contain them)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def first_stop(text: str, stop: Sequence[str], start: int = 0) -> int | None:
    """Where the first occurrence of any stop string at or after `start` begins in `text`; None: none."""
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(hits) if hits else None


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` before the first stop string (the whole text when none occurs)."""
    at = first_stop(text, stop)
    return text if at is None else text[:at]


def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)
