"""Our top-level package is named ``kernels``, like the Hugging Face hub ``kernels`` package that
transformers probes for. These checks run in a fresh interpreter whose cwd is the repo root, so our
``kernels`` is the one found on sys.path, and prove transformers is unaffected by it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def _run_fresh(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"fresh interpreter failed:\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_import_kernels_is_light():
    out = _run_fresh(
        """
        import os, sys, kernels
        assert os.path.dirname(kernels.__file__) == os.path.join(os.getcwd(), "kernels"), kernels.__file__
        assert not hasattr(kernels, "__version__"), "a __version__ makes transformers treat us as hub kernels"
        heavy = [m for m in ("torch", "transformers") if m in sys.modules]
        assert not heavy, f"import kernels pulled in {heavy}"
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_transformers_unaffected_by_our_kernels_package():
    out = _run_fresh(
        """
        import importlib.util, os
        import torch, transformers
        from transformers.utils.import_utils import is_kernels_available
        spec = importlib.util.find_spec("kernels")
        assert spec is not None and spec.origin.startswith(os.getcwd()), f"expected our kernels, got {spec}"
        assert is_kernels_available() is False
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        ids = torch.tensor([[1, 5, 9, 3]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 8), out.shape
        from kernels.model.llama import LlamaForCausalLM  # ours still importable alongside
        print("ok")
        """
    )
    assert out.strip().endswith("ok")
