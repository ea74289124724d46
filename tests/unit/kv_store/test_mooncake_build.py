"""Which Mooncake build is installed and whether it fits torch (`kv_store/transfer/mooncake_build.py`)."""

from __future__ import annotations

import pytest

from kv_store.transfer import mooncake_build
from kv_store.transfer.mooncake_build import MooncakeBuild, check

NON_CUDA = MooncakeBuild("mooncake-transfer-engine-non-cuda", "0.3.7", None)
CU12 = MooncakeBuild("mooncake-transfer-engine", "0.3.13.post1", 12)
CU13 = MooncakeBuild("mooncake-transfer-engine-cuda13", "0.3.14", 13)


def test_this_environment_has_the_cpu_extras_build_alone():
    [build] = mooncake_build.installed()
    assert build.distribution == NON_CUDA.distribution and not build.reads_device_memory
    assert check([build], None) == build


def test_a_cuda_build_reads_device_memory_where_its_cuda_is_torchs():
    assert check([CU13], "13.0") == CU13 and CU13.reads_device_memory
    assert check([CU12], "12.8") == CU12
    assert check([NON_CUDA], "13.0") == NON_CUDA  # host memory only: a GPU worker ships through staging
    assert check([], "13.0") is None


@pytest.mark.parametrize("builds, torch_cuda, message", [
    ([CU12], "13.0", r"mooncake-transfer-engine is built for CUDA 12 and torch for CUDA 13\.0: install "
                     r"mooncake-transfer-engine-cuda13 instead \(tandem's extra 'gpu'\)"),
    ([CU13], "12.8", r"built for CUDA 13 and torch for CUDA 12\.8: install mooncake-transfer-engine instead "
                     r"\(tandem's extra 'gpu-cu12'\)"),
    ([NON_CUDA, CU13], "13.0", r"mooncake-transfer-engine-non-cuda 0\.3\.7 and mooncake-transfer-engine-cuda13 "
                               r"0\.3\.14 are installed into the one `mooncake` package"),
])
def test_mismatched_or_clashing_builds_are_refused_with_the_fix(builds, torch_cuda, message):
    with pytest.raises(RuntimeError, match=message):
        check(builds, torch_cuda)
