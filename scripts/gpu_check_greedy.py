"""The serve step's greedy check: a few fixed prompts through the served /v1/completions (temperature
0, `ignore_eos`, token ids from vLLM's non-streaming `return_token_ids`) against HF transformers'
greedy generation of the same model on the same device and dtype.

Two implementations that sum in different orders (tandem's kernels and HF's, bf16 above all) part
legitimately at a step where the top two logits are within rounding of each other; the rule is the
bf16 served test's (tests/integration/test_serve_bf16.py): the served tokens are the reference's up to
the first step that differs, and there the reference's own top two logits must be within `NEAR_TIE`.
Per prompt the verdict is "equal", "near-tie at step K (gap G)" or "differs at step K (gap G)".

    reference(): run as `gpu_check_steps.py greedy-reference --out F -- SERVE_ARGS` beside the server
                 while it starts; resolves the served model, device and dtype from the same
                 `tandem serve` arguments; writes F (standard library at import; torch lazily)
    complete_all(), compare(): the serve driver, once the server is ready
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import time
import urllib.error
import urllib.request

from gpu_check_common import write_json

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Water boils at")
MAX_TOKENS = 16
NEAR_TIE = 0.5  # logits: the bf16 served test's rule (four bf16 steps at SmolLM2's top logits)


# ---- the reference (a child process of the serve step) ---------------------------------------------------
def served_engine(serve_args: list[str]) -> dict:
    """The model, device and dtype the tokens come from, as `tandem serve SERVE_ARGS` resolves them: the
    decode group's (the colocated one's when there is none; prefill must match its dtype)."""
    from cluster.cli.main import build_parser
    from cluster.serve.config_load import serve_config_from_args

    config = serve_config_from_args(build_parser().parse_args(["serve", *serve_args]))
    engine = config.decode.engine if config.decode.count else config.colocated.engine
    return {"model": config.model, "device": engine.device, "dtype": engine.dtype}


def reference(args: argparse.Namespace) -> int:
    """HF greedy over PROMPTS: per prompt its token ids, the greedy tokens, each step's top-two gap."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kernels.model.loader import resolve_model_dir

    started = time.monotonic()
    served = served_engine(args.serve_args)
    model_dir = resolve_model_dir(served["model"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, served["dtype"]))
    model = model.to(served["device"]).eval()
    model.generation_config.eos_token_id = None  # served with ignore_eos
    out: dict = {**served, "model_dir": str(model_dir), "max_tokens": args.max_tokens, "prompts": []}
    for prompt in args.prompts or PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        tokens, gaps = hf_greedy(model, ids, args.max_tokens)
        out["prompts"].append({"prompt": prompt, "prompt_ids": ids, "tokens": tokens, "gaps": gaps})
    out["wall_s"] = round(time.monotonic() - started, 2)
    write_json(args.out, out)
    print(json.dumps(out, indent=1), flush=True)
    return 0


def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """(greedy tokens, each step's gap between its top two logits)."""
    import torch

    ids = torch.tensor([prompt_ids], device=model.device)  # [1, prompt_len]
    with torch.inference_mode():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    gaps = [float(top[0] - top[1]) for top in (s[0].float().topk(2).values for s in gen.scores)]
    return gen.sequences[0, len(prompt_ids):].tolist(), gaps


# ---- the served side ------------------------------------------------------------------------------------
def complete(url: str, prompt: str, max_tokens: int, timeout_s: float) -> dict:
    """One greedy /v1/completions: {"prompt_ids", "tokens"} or {"error"}."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            choice = json.loads(resp.read())["choices"][0]
    except urllib.error.HTTPError as err:
        return {"error": f"HTTP {err.code}: {err.read()[:300].decode(errors='replace')}"}
    except (OSError, ValueError, KeyError, IndexError) as err:
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    return {"prompt_ids": choice.get("prompt_token_ids"), "tokens": choice.get("token_ids")}


def complete_all(url: str, prompts: tuple[str, ...], max_tokens: int, timeout_s: float) -> list[dict]:
    """Every prompt at once (one decode batch of them), each answer in prompt order."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(url, p, max_tokens, timeout_s), prompts))


def compare(served: list[dict], ref: dict) -> list[dict]:
    """Per prompt: the served and reference tokens, whether the prompt ids agree, where the tokens
    first differ (None: nowhere), the reference's top-two gap there, and the verdict (module docstring)."""
    out = []
    for answer, want in zip(served, ref["prompts"]):
        entry = {"prompt": want["prompt"], "served": answer.get("tokens"), "reference": want["tokens"]}
        if "error" in answer or answer.get("tokens") is None:
            out.append({**entry, "verdict": f"no answer: {answer.get('error', 'no token_ids')}"})
            continue
        tokens, expected = answer["tokens"], want["tokens"]
        step = next((i for i, (got, exp) in enumerate(zip(tokens, expected)) if got != exp), None)
        gap = None if step is None else want["gaps"][step]
        if step is None:
            verdict = ("equal" if len(tokens) == len(expected)
                       else f"{len(tokens)} tokens, the reference {len(expected)}")
        elif gap < NEAR_TIE:
            verdict = f"near-tie at step {step} (gap {gap:.3f})"
        else:
            verdict = f"differs at step {step} (gap {gap:.3f})"
        out.append({**entry, "prompt_ids_equal": answer.get("prompt_ids") == want["prompt_ids"],
                    "first_difference": step, "gap_at_difference": gap, "verdict": verdict})
    return out


def add_reference_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--prompt", dest="prompts", action="append", default=[], help="default: PROMPTS")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then `tandem serve` flags")
