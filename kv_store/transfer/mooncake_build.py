"""Which Mooncake build is installed, and whether it fits this torch (no import of `mooncake` itself).

PyPI has three builds of the transfer engine, each installing the same `mooncake` package:

    mooncake-transfer-engine-non-cuda   host memory only (tandem's `cpu` extra)
    mooncake-transfer-engine            CUDA 12: reads GPU memory (TCP through cudaMemcpy, RDMA)
    mooncake-transfer-engine-cuda13     CUDA 13 (tandem's `gpu` extra: current torch wheels are CUDA 13)

Two installed at once overwrite each other's files in one package, so which one runs is an accident:
`check` refuses that, and a CUDA build whose CUDA major is not torch's (its libcudart would not load,
or load beside a second one). `reads_device_memory` is what a transport may register: device memory
only with a CUDA build.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

BUILDS: dict[str, int | None] = {
    "mooncake-transfer-engine-non-cuda": None,
    "mooncake-transfer-engine": 12,
    "mooncake-transfer-engine-cuda13": 13,
}
"""Distribution -> the CUDA major it is built for (None: no CUDA)."""
EXTRA_OF_CUDA = {None: "cpu", 12: "gpu-cu12", 13: "gpu"}


@dataclass(frozen=True)
class MooncakeBuild:
    distribution: str
    version: str
    cuda_major: int | None  # None: the non-CUDA build

    @property
    def reads_device_memory(self) -> bool:
        return self.cuda_major is not None


def installed() -> list[MooncakeBuild]:
    """Every Mooncake build installed in this environment."""
    found = []
    for name, cuda_major in BUILDS.items():
        try:
            found.append(MooncakeBuild(name, importlib.metadata.version(name), cuda_major))
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def check(builds: list[MooncakeBuild], torch_cuda: str | None) -> MooncakeBuild | None:
    """The one build to use, given torch's CUDA version (`torch.version.cuda`; None: a CPU torch).
    None when none is installed. Raises RuntimeError naming the fix when two are installed, or when a
    CUDA build does not match torch's CUDA major."""
    if not builds:
        return None
    if len(builds) > 1:
        names = " and ".join(f"{b.distribution} {b.version}" for b in builds)
        raise RuntimeError(f"{names} are installed into the one `mooncake` package (each overwrites the other): "
                           f"uninstall all but one (tandem's extras: cpu, gpu for CUDA 13, gpu-cu12)")
    build = builds[0]
    torch_major = int(torch_cuda.split(".")[0]) if torch_cuda else None
    if build.cuda_major is not None and torch_major is not None and build.cuda_major != torch_major:
        want = next(name for name, major in BUILDS.items() if major == torch_major) if torch_major in BUILDS.values() \
            else f"a CUDA {torch_major} build"
        raise RuntimeError(f"{build.distribution} is built for CUDA {build.cuda_major} and torch for CUDA "
                           f"{torch_cuda}: install {want} instead (tandem's extra "
                           f"'{EXTRA_OF_CUDA.get(torch_major, 'gpu')}')")
    return build


def checked() -> MooncakeBuild | None:
    """The installed build checked against this process's torch (`check`); None when none is."""
    try:
        import torch

        torch_cuda = torch.version.cuda
    except ImportError:
        torch_cuda = None
    return check(installed(), torch_cuda)
