"""lm-evaluation-harness against a served tandem (imported by the serve test modules): a small
multiple-choice task stored in the repo (`tests/data/lm_eval/`), scored through lm-eval's
`local-completions` model (token-id prompts, `echo`, `logprobs: 1`: its loglikelihood requests),
gives the accuracy of lm-eval's own `hf` backend on the same weights, each choice's loglikelihood
within 1e-3 of that backend's."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from tests.helpers import smollm2

DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval" / "multiple_choice.jsonl"
TASK = "tandem_mc"
TOLERANCE = 1e-3


def _task_dir() -> Path:
    """A directory holding the task's YAML (written here: it names the data file by absolute path)."""
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-lm-eval-{os.getpid()}"
    root.mkdir(exist_ok=True)
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {DATA}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n")
    return root


def _evaluate(model: str, model_args: str) -> tuple[float, list[list[float]]]:
    """(accuracy, per question each choice's loglikelihood) of `model` on the task."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True,
                          task_manager=TaskManager(include_path=str(_task_dir()), include_defaults=False))
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return out["results"][TASK]["acc,none"], [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


@functools.cache
def hf_reference() -> tuple[float, list[list[float]]]:
    loaded, _ = smollm2()
    return _evaluate("hf", f"pretrained={loaded.model_dir},dtype=float32,device=cpu,batch_size=8")


def check_lm_eval(base_url: str, api_key: str = "") -> None:
    loaded, _ = smollm2()
    args = (f"model=smollm2,base_url={base_url}/v1/completions,tokenizer={loaded.model_dir},"
            "tokenizer_backend=huggingface,tokenized_requests=True,batch_size=4,num_concurrent=2,max_retries=1")
    before = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = api_key  # where lm-eval's local-completions reads its key
    try:
        acc, served = _evaluate("local-completions", args)
    finally:
        if before is None:
            os.environ.pop("OPENAI_API_KEY")
        else:
            os.environ["OPENAI_API_KEY"] = before
    want_acc, want = hf_reference()
    assert len(served) == len(want) == sum(1 for _ in DATA.open())
    for got_choices, want_choices in zip(served, want):
        assert got_choices == pytest.approx(want_choices, abs=TOLERANCE)
    assert acc == want_acc
    assert 0 < want_acc < 1 or want_acc == 1, "the reference scored nothing: the task proves little"
