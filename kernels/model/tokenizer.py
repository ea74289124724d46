"""Text <-> token ids with a model's Hugging Face tokenizer and chat template. No torch: the gateway
uses these without loading any model code."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # jinja2 loads on first chat template use
    import jinja2

REPLACEMENT_CHAR = "\ufffd"  # what a decode of an incomplete UTF-8 byte sequence ends with


TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer the gateway serves with: `ServingTokenizer` where the model directory has a fast
    tokenizer (`tokenizer.json`) and a plain chat template, else transformers' AutoTokenizer."""
    model_dir = Path(model_dir)
    if (model_dir / TOKENIZER_FILE).is_file():
        template = _chat_template(model_dir)
        if template is None or "{% generation" not in template:
            return ServingTokenizer(model_dir, template)
    return load_hf_tokenizer(model_dir)


def load_hf_tokenizer(model_dir: Path) -> Any:
    """transformers' AutoTokenizer (the engine's: its process has torch anyway, and model code may
    ask for more of its interface than `ServingTokenizer` has)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class ServingTokenizer:
    """A model's fast tokenizer (`tokenizer.json` through the `tokenizers` library) and its Jinja chat
    template, rendered as transformers renders it (a sandbox with trim_blocks and lstrip_blocks, loop
    controls, `raise_exception`, `strftime_now`, a non-escaping `tojson`, the special tokens as
    variables), without transformers: loading transformers' tokenizer loads torch, hundreds of MB
    more RAM in the gateway's process. The subset of transformers' tokenizer interface the gateway uses;
    a test holds its ids and text equal to AutoTokenizer's."""

    def __init__(self, model_dir: Path, chat_template: str | None) -> None:
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        self._tokenizer = Tokenizer.from_file(str(self.model_dir / TOKENIZER_FILE))
        config = _read_config(Path(model_dir))
        self.chat_template = chat_template
        self.special_tokens = {k: _token_text(v) for k, v in config.items()
                               if k.endswith("_token") and _token_text(v) is not None}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._template: jinja2.Template | None = None

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The id of tokenizer_config.json's `eos_token` (None without one), as transformers gives it."""
        text = self.special_tokens.get("eos_token")
        return None if text is None else self._tokenizer.token_to_id(text)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, list]:
        """{"input_ids": ids} of one text, or a list of ids per text of a list."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}
        batch = self._tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return {"input_ids": [enc.ids for enc in batch]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_tokenization_spaces else text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, tools: list[dict] | None = None) -> str | list[int]:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        text = self._template.render(messages=messages, tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self.special_tokens)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _read_config(model_dir: Path) -> dict:
    path = model_dir / TOKENIZER_CONFIG
    return json.loads(path.read_text()) if path.is_file() else {}


def _chat_template(model_dir: Path) -> str | None:
    """The chat template as transformers finds it: `chat_template.jinja`, else tokenizer_config.json's
    `chat_template` (a string, or named templates of which "default" is the one used)."""
    if (model_dir / CHAT_TEMPLATE_FILE).is_file():
        return (model_dir / CHAT_TEMPLATE_FILE).read_text()
    template = _read_config(model_dir).get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it (a string or an AddedToken dict) -> its text."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _compile_template(source: str) -> jinja2.Template:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(source)


def _clean_up_spaces(text: str) -> str:
    """transformers' `clean_up_tokenization` (for tokenizers that ask for it)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def apply_chat_template(tokenizer: Any, messages: list[dict] | str, tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` (or one user message ``str``) with the assistant prompt appended;
    ``tools`` (OpenAI's `tools` items) go to the template, for templates that render them."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; use encode_prompt() for raw completions")
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
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
