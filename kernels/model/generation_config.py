"""The model's recommended sampling: what fills a request's unset sampling fields under
`gateway.generation_config: auto` (vLLM's `--generation-config auto`). No torch: the gateway's
process resolves it at start-up.

    model                          auto                                        none
    smollm2 (bundled)              its model card's: temperature 0.2, top_p 0.9  the OpenAI API's:
    a local HF dir                 its generation_config.json's temperature,    temperature 1,
                                   top_p, top_k (each only where it is set)     top_p 1, top_k off

The bundled GGUF carries no generation config, so the values SmolLM2-135M-Instruct's model card
publishes for chat stand in for it: at the OpenAI default of temperature 1 the 135M model rambles
off topic. As in vLLM, `do_sample` is not consulted: a file that names a temperature recommends it.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.config import GENERATION_CONFIG_MODES, ConfigError, SamplingDefaults, require
from kernels.model.convert import SMOLLM2_SPEC

SMOLLM2_CARD = SamplingDefaults(temperature=0.2, top_p=0.9, source="the SmolLM2-135M-Instruct model card")
GENERATION_CONFIG_FILE = "generation_config.json"


def sampling_defaults(mode: str, model_spec: str, model_dir: Path) -> SamplingDefaults:
    """The defaults `mode` ("auto" | "none") gives for the model `model_spec`, found in `model_dir`.
    A generation_config.json that is not JSON, or holds a value out of bounds, is a `ConfigError`
    naming the file."""
    require(mode in GENERATION_CONFIG_MODES,
            f"gateway.generation_config must be one of {GENERATION_CONFIG_MODES}, got {mode!r}")
    if mode == "none":
        return SamplingDefaults(source="the OpenAI API's defaults (generation_config: none)")
    if model_spec == SMOLLM2_SPEC:
        return SMOLLM2_CARD
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return SamplingDefaults(source=f"the OpenAI API's defaults ({model_dir} has no {GENERATION_CONFIG_FILE})")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})") from None
    require(isinstance(raw, dict), f"{path}: expected a JSON object")
    fields = {name: raw[name] for name in ("temperature", "top_p", "top_k") if raw.get(name) is not None}
    try:
        return SamplingDefaults(**fields, source=str(path))
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
