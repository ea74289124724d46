"""The gateway's tokenizer (`ServingTokenizer`: the `tokenizers` library and a Jinja sandbox, no
transformers, no torch) gives exactly what transformers' AutoTokenizer gives on the same model
directory: chat-template text and ids, plain encodes, decodes with and without special tokens, the
vocabulary size; and it loads no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kernels.model.convert import resolve_model_dir
from kernels.model.tokenizer import ServingTokenizer, apply_chat_template, encode_prompt, load_tokenizer
from tests.helpers import CHAT_PROMPTS

TEXTS = [*CHAT_PROMPTS, "", " leading space", "tabs\tand\nnewlines\n\n", "émoji 🦀 and 中文 and ﬁ ligature",
         "<|im_start|>user\nliteral special tokens<|im_end|>", "  double  spaces  ", "don't , . ! ?"]
CONVERSATIONS = [
    [{"role": "user", "content": p}] for p in CHAT_PROMPTS[:4]
] + [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 🦀."}],
]


@pytest.fixture(scope="module")
def both():
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir("smollm2")
    return load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)


def test_the_gateway_loads_the_light_tokenizer(both):
    light, _ = both
    assert isinstance(light, ServingTokenizer)


def test_chat_template_text_and_ids_equal_transformers(both):
    light, hf = both
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert light.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False) == \
                hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
        assert apply_chat_template(light, messages) == apply_chat_template(hf, messages)


def test_encode_decode_and_vocab_size_equal_transformers(both):
    light, hf = both
    assert len(light) == len(hf)
    for text in TEXTS:
        ids = encode_prompt(light, text)
        assert ids == encode_prompt(hf, text), text
        assert light.encode(text) == hf.encode(text), text
        with_specials = [*hf.encode("<|im_start|>"), *ids, *hf.encode("<|im_end|>")]
        for skip in (True, False):
            assert light.decode(with_specials, skip_special_tokens=skip) == \
                hf.decode(with_specials, skip_special_tokens=skip), text
    assert light(TEXTS, add_special_tokens=False)["input_ids"] == hf(TEXTS, add_special_tokens=False)["input_ids"]
    for window in ([], [0], list(range(200, 260)), [len(hf) - 1]):
        assert light.decode(window, skip_special_tokens=True) == hf.decode(window, skip_special_tokens=True)


def test_a_template_that_raises_raises_and_named_templates_pick_default(tmp_path, both):
    import jinja2

    light, _ = both
    model_dir = resolve_model_dir("smollm2")
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    named = [{"name": "tool_use", "template": "tools"},
             {"name": "default", "template": "{% if messages|length > 1 %}{{ raise_exception('one only') }}"
                                             "{% endif %}{{ bos_token }}{{ messages[0]['content']|tojson }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named,
                                                                "bos_token": {"content": "<|im_start|>"}}))
    tok = load_tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "é\"<"}], tokenize=False) == '<|im_start|>"é\\"<"'
    with pytest.raises(jinja2.exceptions.TemplateError, match="one only"):
        tok.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(load_tokenizer(tmp_path), "hi")
    assert len(light) > 0


def test_loading_and_using_it_imports_neither_torch_nor_transformers():
    code = ("import sys; from kernels.model.convert import resolve_model_dir; "
            "from kernels.model.tokenizer import load_tokenizer, apply_chat_template; "
            "t = load_tokenizer(resolve_model_dir('smollm2')); t.decode(apply_chat_template(t, 'hi')); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
