"""llama.cpp's copy of the bundled SmolLM2 for `tandem bench llamacpp`: the GGUF tandem loads,
dequantized to float32 (or, `bfloat16`, its matrices rounded to bf16), written once into the cache."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger("tandem.bench")

GGUF_NAMES = {"float32": "smollm2-135m-instruct-f32.gguf", "bfloat16": "smollm2-135m-instruct-bf16.gguf"}
"""llama.cpp's copy of the bundled SmolLM2 per `--dtype`, in the cache."""
F32_GGUF_NAME = GGUF_NAMES["float32"]
SOURCE_KEY = "tandem.f32_source"  # "<source file name>:<bytes>": which GGUF this file was made from


def write_gguf(source: Path, out_path: Path, source_tag: str, dtype: str = "float32") -> None:
    """`source` with every tensor dequantized to float32 (gguf's reference dequantizer, the values
    tandem loads) and all its metadata, `SOURCE_KEY` = `source_tag`. bfloat16: every matrix rounded
    to bf16 (to nearest even, as torch's cast rounds the same values for tandem), the 1-D norm
    weights kept in f32 as llama.cpp's own converter keeps them; `general.file_type` says which."""
    import gguf

    if dtype not in GGUF_NAMES:
        raise ValueError(f"no GGUF of dtype {dtype!r} (one of {sorted(GGUF_NAMES)})")

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out_path, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue  # the header's own fields, the one the writer adds, the one that changes
        is_array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if is_array else None)
    bf16 = dtype == "bfloat16"
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    writer.add_string(SOURCE_KEY, source_tag)
    for tensor in reader.tensors:  # numpy shape = ggml's ne reversed, so the writer restores ne
        values = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if bf16 and values.ndim >= 2:
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_source(path: Path) -> str | None:
    """The `SOURCE_KEY` stamp of a GGUF `write_gguf` wrote; None when the file is absent, unreadable or unstamped."""
    import gguf

    try:
        field = gguf.GGUFReader(path).fields.get(SOURCE_KEY)
    except (OSError, ValueError):
        return None
    return None if field is None else field.contents()


def ensure_gguf(cache_root: Path | None = None, dtype: str = "float32") -> Path:
    """The `dtype` GGUF of the bundled SmolLM2 for llama.cpp, converted once (a tmp file renamed into place)."""
    from kernels.model.convert import default_cache_root, smollm2_gguf_path

    source = smollm2_gguf_path()
    tag = f"{source.name}:{source.stat().st_size}"
    name = GGUF_NAMES[dtype]
    final = (cache_root or default_cache_root()) / "models" / name
    if gguf_source(final) == tag:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    log.info("writing the %s GGUF for llama.cpp (once): %s -> %s", dtype, source.name, final)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=final.parent)
    os.close(fd)
    try:
        write_gguf(source, Path(tmp), tag, dtype)
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)  # atomic: a concurrent reader sees the old file or the whole new one
    finally:
        Path(tmp).unlink(missing_ok=True)
    return final
