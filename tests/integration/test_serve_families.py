"""Architectures beyond Llama served end to end: tiny random checkpoints written by transformers (with
SmolLM2's tokenizer beside them), served disaggregated by `tandem run --mode disaggregated` (prefill
and decode worker processes, KV crossing between them) and by `tandem serve` (Ray actors over Mooncake
TCP, the official `openai` client, every worker over two tensor-parallel ranks), against transformers'
greedy tokens; `tandem run` with one side over two ranks."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch

from cluster.cli.main import main as tandem_main
from kernels.model.convert import resolve_model_dir
from tests.integration.serve_harness import metric, serving
from tests.unit.engine.test_model_families import reference

pytestmark = pytest.mark.slow

VOCAB = 49152  # SmolLM2's tokenizer
PROMPT = "The harbour town was quiet before the boats came in, and the market " * 3
NEW_TOKENS = 10
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_checkpoint(name: str, path) -> list[int]:
    """A tiny model of family `name` at `path` with SmolLM2's tokenizer; transformers' greedy tokens after PROMPT."""
    from kernels.model.tokenizer import load_tokenizer

    model = reference(name, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(path)
    for file in TOKENIZER_FILES:
        shutil.copy(resolve_model_dir("smollm2") / file, path / file)
    ids = load_tokenizer(path).encode(PROMPT, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name,side", [("qwen3-moe", "prefill"), ("gemma3", "decode")])  # the others: unit-tested
def test_tandem_run_disaggregated_across_tp_degrees_gives_transformers_greedy_tokens(name, side, tmp_path, capsys):
    """The `side` worker over 2 ranks (its 2 KV heads one a rank), the other on one: each prefill rank
    writes its head into the decode landing(s) holding it."""
    expected = write_checkpoint(name, tmp_path)
    capsys.readouterr()
    assert tandem_main(["run", "--model", str(tmp_path), "--mode", "disaggregated", "--raw", "--json",
                        "--prompt", PROMPT, "--max-tokens", str(NEW_TOKENS), "--page-size", "4",
                        f"--{side}-tensor-parallel-size", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["token_ids"] == expected, name


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """A tiny Gemma 2 (windowed and global layers alternating, window 8, soft caps) served with the
    defaults but `-tp 2`: disaggregated, a prefill and a decode worker each over two ranks, KV integrity
    checked after every step (every family so: `scripts/serve_families.py`)."""
    path = tmp_path_factory.mktemp("gemma2-model")
    expected = write_checkpoint("gemma2", path)
    with serving(tmp_path_factory, "serve-gemma2", ["--model", str(path), "-tp", "2"], env={"TANDEM_DEBUG_KV": "1"},
                 warm=False) as server:  # not timing-bound: its decode step may compile beside serving
        yield server, expected


def test_served_gemma2_at_tp2_gives_transformers_greedy_tokens_again_from_its_prefix_cache(gemma2):
    server, expected = gemma2
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    ask = dict(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0,
               extra_body={"ignore_eos": True, "return_token_ids": True})
    before = server.metrics()
    first = client.completions.create(**ask)
    assert first.choices[0].token_ids == expected
    again = client.completions.create(**ask)
    assert again.choices[0].token_ids == expected
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    after = server.metrics()
    assert metric(after, "tandem:request_success_total") - metric(before, "tandem:request_success_total") == 2
    chat = client.chat.completions.create(model=ask["model"], messages=[{"role": "user", "content": "Hello!"}],
                                          max_tokens=6, temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1
