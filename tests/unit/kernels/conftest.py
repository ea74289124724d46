"""Without a CUDA device the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``) on
CPU tensors; with one they run compiled on it.

Triton reads the variable as each ``@triton.jit`` function is defined, its own library's (e.g.
``tl.cdiv``) included, so it must be set before ``triton`` is first imported: here at the latest,
since this file loads before the test modules of its directory. If a module collected earlier
imported triton already, the interpreter cannot be switched on and these tests fail saying so.
"""

import os
import sys

import pytest
import torch

_TOO_LATE = False
if not torch.cuda.is_available():
    _TOO_LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def triton_interpreted():
    """Fails a Triton test whose kernels cannot be interpreted (use with ``usefixtures``)."""
    if _TOO_LATE:
        pytest.fail(
            "triton was imported before tests/unit/kernels/conftest.py could set TRITON_INTERPRET=1: "
            "import triton lazily in test modules collected earlier, or set the variable in tests/conftest.py"
        )
