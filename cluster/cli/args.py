"""Command-line pieces shared by the `tandem` subcommands and the benches that parse them (kept apart
from `main`, so a bench never imports the entry point that imports it). The engine flags themselves
live beside `EngineConfig` (`common/engine_flags.py`); a speculative config's default head is found
by `cluster.train.shipped.with_default_draft`."""

from __future__ import annotations

import argparse
import dataclasses

from cluster.train.shipped import with_default_draft
from common.config import EngineConfig
from common.engine_flags import ENGINE_FLAGS, add_engine_args, engine_fields_from_args

__all__ = ["ENGINE_FLAGS", "add_engine_args", "engine_config_from_args", "engine_fields_from_args",
           "with_default_draft"]


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    return with_default_draft(dataclasses.replace(EngineConfig(), **{**engine_fields_from_args(args), **overrides}))
