"""The engine on the real SmolLM2-135M-Instruct vs HF transformers' greedy generate."""

import json

import pytest

from cluster.cli.main import main
from engine.request import FinishReason
from kernels.model.tokenizer import apply_chat_template, encode_prompt
from tests.helpers import CHAT_PROMPTS, assert_pool_at_rest, greedy, hf_greedy, make_smollm2_engine, smollm2

pytestmark = pytest.mark.slow
MAX_NEW = 24


@pytest.fixture(scope="module")
def chat_ids():
    loaded, _ = smollm2()
    return [apply_chat_template(loaded.tokenizer, p) for p in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def hf_outputs(chat_ids):
    loaded, ref = smollm2()
    return [hf_greedy(ref, ids, MAX_NEW, eos_token_id=list(loaded.eos_token_ids)) for ids in chat_ids]


def test_prompts_have_mixed_lengths(chat_ids):
    lengths = sorted(map(len, chat_ids))
    assert lengths[0] < 40 and lengths[-1] > 150, lengths


@pytest.mark.parametrize("page_size,chunk_size,num_pages", [(1, 512, 8192), (16, 512, 512), (16, 32, 512),
                                                            (16, 64, 1 + 600 // 16)])
def test_batched_chat_greedy_matches_hf(chat_ids, hf_outputs, page_size, chunk_size, num_pages):
    engine = make_smollm2_engine(page_size=page_size, chunk_size=chunk_size, num_pages=num_pages)
    out = engine.generate(chat_ids, greedy(max_tokens=MAX_NEW))
    assert [r.output_token_ids for r in out] == hf_outputs
    if num_pages * page_size < sum(map(len, chat_ids)):
        assert engine.num_retractions > 0, "the small pool should have forced retraction"
    if chunk_size == 32:
        assert max(map(len, chat_ids)) >= 3 * 32, "longest prompt should take >= 3 chunks"
    assert_pool_at_rest(engine)


def test_shared_200_token_prefix_is_cached():
    loaded, _ = smollm2()
    system = "You are a meticulous assistant. " + "Answer carefully, cite facts, and keep it short. " * 18
    first = apply_chat_template(loaded.tokenizer, [{"role": "system", "content": system},
                                                   {"role": "user", "content": "Name a red fruit."}])
    second = apply_chat_template(loaded.tokenizer, [{"role": "system", "content": system},
                                                    {"role": "user", "content": "Name a yellow fruit."}])
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 200
    cold = make_smollm2_engine(page_size=16, enable_prefix_cache=False)
    expect = [r.output_token_ids for r in cold.generate([first, second], greedy(max_tokens=12))]
    warm = make_smollm2_engine(page_size=16)
    [a] = warm.generate([first], greedy(max_tokens=12))
    [b] = warm.generate([second], greedy(max_tokens=12))
    assert b.cached_tokens >= 192 and b.cached_tokens == shared // 16 * 16
    assert [a.output_token_ids, b.output_token_ids] == expect
    assert_pool_at_rest(warm)


def test_stop_string_truncates_text(chat_ids, hf_outputs):
    loaded, _ = smollm2()
    full = loaded.tokenizer.decode(hf_outputs[2], skip_special_tokens=True)
    stop = full.split()[3]
    engine = make_smollm2_engine()
    [r] = engine.generate([chat_ids[2]], greedy(max_tokens=MAX_NEW, stop=(stop,)))
    assert r.finish_reason is FinishReason.STOP
    assert engine.output_text(r) == full[:full.index(stop)]
    assert r.output_token_ids == hf_outputs[2][:len(r.output_token_ids)]
    assert_pool_at_rest(engine)


def test_cli_run_json_matches_hf(tmp_path, capsys, chat_ids, hf_outputs):
    loaded, ref = smollm2()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": CHAT_PROMPTS[3]}]}) + "\n"
                       + json.dumps("The three primary colors are") + "\n")
    rc = main(["run", "--prompt", CHAT_PROMPTS[1], "--prompts-file", str(prompts), "--max-tokens", str(MAX_NEW),
               "--num-pages", "256", "--json"])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows][0] == CHAT_PROMPTS[1] and len(rows) == 3
    assert rows[0]["token_ids"] == hf_outputs[1] and rows[1]["token_ids"] == hf_outputs[3]
    assert rows[2]["prompt_token_ids"] == apply_chat_template(loaded.tokenizer, "The three primary colors are")
    for row in rows:
        assert set(row) == {"prompt", "prompt_token_ids", "token_ids", "text", "finish_reason", "prompt_tokens",
                            "completion_tokens", "cached_tokens"}
        assert row["text"] == loaded.tokenizer.decode(row["token_ids"], skip_special_tokens=True)
        assert row["completion_tokens"] == len(row["token_ids"])
        assert row["prompt_tokens"] == len(row["prompt_token_ids"])
    raw = main(["run", "--prompt", "The three primary colors are", "--raw", "--max-tokens", "8", "--num-pages", "64",
                "--json"])
    assert raw == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    raw_prompt = encode_prompt(loaded.tokenizer, "The three primary colors are")
    assert row["prompt_token_ids"] == raw_prompt
    assert row["token_ids"] == hf_greedy(ref, raw_prompt, 8, eos_token_id=list(loaded.eos_token_ids))


def test_cli_run_speculative_with_a_published_head_matches_hf(tmp_path, capsys, chat_ids, hf_outputs):
    """`tandem run --speculative eagle --draft-model DIR` with an (untrained) EAGLE-3 head written in the
    published layout: flags -> config -> head loaded beside the model -> the same greedy tokens as HF."""
    from cluster.train.checkpoint import new_head, write_published
    from cluster.train.vocab import most_frequent

    loaded, _ = smollm2()
    vocab = most_frequent(hf_outputs, 1024, loaded.arch.vocab_size)
    write_published(tmp_path, new_head(loaded.model, vocab, seed=0), vocab, loaded.arch)
    rc = main(["run", "--prompt", CHAT_PROMPTS[1], "--prompt", CHAT_PROMPTS[3], "--max-tokens", str(MAX_NEW),
               "--num-pages", "256", "--json", "--speculative", "eagle", "--draft-model", str(tmp_path)])
    assert rc == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in rows] == [hf_outputs[1], hf_outputs[3]]


def test_cli_rejects_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    assert main(["run", "--prompts-file", str(bad), "--num-pages", "64"]) == 2
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err
    assert main(["run", "--num-pages", "64"]) == 2
    assert "no prompts" in capsys.readouterr().err
    assert main(["run", "--prompt", "x", "--page-size", "3", "--num-pages", "64"]) == 2
    assert "page_size must be a power of two" in capsys.readouterr().err
    assert main(["run", "--prompt", "x", "--model", str(tmp_path / "nope"), "--num-pages", "64"]) == 2
    assert "neither a known name" in capsys.readouterr().err
