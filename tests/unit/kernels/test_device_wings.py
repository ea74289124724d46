"""Where CPU code ends and CUDA code begins (docs/design.md §11, §12): each device's kernels live in
its wing (`kernels/cpu/`, `kernels/cuda/`), neither wing imports the other, the rest of tandem
reaches a wing only through the named entry points below, and the engine asks which device it is on
at one place (`engine/graphs/strategy.py`)."""

from __future__ import annotations

import re

import pytest

from tests.unit.cluster.test_layering import PACKAGES, ROOT, _module_name, imports_of

WINGS = ("kernels.cpu", "kernels.cuda")
ENTRY_POINTS = {
    # importer -> the wing modules it may name
    "kernels.attention": {"kernels.cpu.attention_backend", "kernels.cpu.native", "kernels.cuda.triton_backend",
                          "kernels.cuda.flashinfer_backend"},  # the backend registry
    "kernels.model.packed_linear": {"kernels.cpu.native"},  # a bf16 CPU matmul (`linear_bf16`)
    "engine.graphs.strategy": {"kernels.cpu.decode_layer"},  # the one place a step strategy is chosen
    "engine.graphs.runner": {"kernels.cpu.compiled"},  # strategy `compiled`: inductor, imported when it compiles
    "kv_store.copier": {"kernels.cuda.page_copy"},  # the one page copier
    "kernels.experts": {"kernels.cuda.fused_moe"},  # MoE experts: the fused Triton kernel on CUDA
}
DEVICE_CHECK = re.compile(r"\.device\.type\b|\bdevice\.type\b|\.is_cuda\b|torch\.cuda\.is_available\(")


def _wing_of(dotted: str) -> str | None:
    return next((w for w in WINGS if dotted == w or dotted.startswith(w + ".")), None)


def _tandem_modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, _module_name(path)


def test_the_wings_hold_their_devices_kernels():
    cpu, cuda = ROOT / "kernels" / "cpu", ROOT / "kernels" / "cuda"
    assert {p.name for p in cpu.glob("*.c")} == {"attention.c", "decode_layer.c", "linear.c"}
    assert {p.name for p in cuda.glob("*.py")} >= {"triton_backend.py", "triton_kernels.py", "flashinfer_backend.py",
                                                   "page_copy.py", "triton_aot.py"}
    elsewhere = [p for p in (ROOT / "kernels").rglob("*") if p.suffix in (".c", ".h") and p.parent != cpu]
    assert not elsewhere, f"C sources outside kernels/cpu/: {elsewhere}"
    triton_users = [p for p in (ROOT / "kernels").rglob("*.py")
                    if p.parent != cuda and re.search(r"^\s*(import triton|from triton)", p.read_text(), re.M)]
    assert not triton_users, f"Triton imported outside kernels/cuda/: {triton_users}"


def test_neither_wing_imports_the_other():
    found = []
    for path, module in _tandem_modules():
        mine = _wing_of(module)
        if mine is None:
            continue
        found += [f"{path.relative_to(ROOT)}:{line}: {imported}" for line, imported in imports_of(path)
                  if _wing_of(imported) not in (None, mine)]
    assert not found, "a wing imports the other:\n" + "\n".join(found)


def test_the_rest_reaches_a_wing_only_through_its_entry_points():
    found = []
    for path, module in _tandem_modules():
        if _wing_of(module) is not None or module.startswith("cluster."):  # cluster: the top layer (benches)
            continue
        allowed = ENTRY_POINTS.get(module, set())
        found += [f"{path.relative_to(ROOT)}:{line}: {imported}" for line, imported in imports_of(path)
                  if _wing_of(imported) is not None and imported not in allowed]
    assert not found, "a device's kernels named outside its entry points:\n" + "\n".join(found)


def test_the_engine_asks_its_device_at_one_place():
    found = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        if path.name == "strategy.py":
            continue
        found += [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in
                  enumerate(path.read_text().splitlines(), 1) if DEVICE_CHECK.search(line)]
    assert not found, "device checks in the engine outside engine/graphs/strategy.py:\n" + "\n".join(found)


@pytest.mark.parametrize("line, hit", [("if x.device.type == 'cuda':", True), ("torch.cuda.is_available()", True),
                                       ("t.is_cuda", True), ("device = torch.device(config.device)", False)])
def test_the_device_check_pattern(line, hit):
    assert bool(DEVICE_CHECK.search(line)) is hit
