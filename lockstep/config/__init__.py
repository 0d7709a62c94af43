"""Run configuration: nested dataclasses (config/schema.py), loaded from YAML, overridden by dotted keys
(config/overrides.py), validated (config/validate.py).

Every field carries a one-line comment. `load_config` is the single entry point; `validate_config`
holds every rule that can be checked before a process starts. Rules that need the world size (batch
arithmetic) live in `resolve_batch`. The package's names are the public face: import them from here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from lockstep.config.overrides import Overrides, all_keys, apply_overrides, flatten, parse_sets
from lockstep.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    DistributedConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from lockstep.config.validate import TRACKERS, check_trackers, parse_profile_steps, validate_config
from lockstep.errors import ConfigError

__all__ = [  # re-exported: the package's face (callers set keys on a Config through here too)
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DistributedConfig",
    "ModelConfig",
    "OptimConfig",
    "Overrides",
    "ParallelConfig",
    "TRACKERS",
    "TrainConfig",
    "all_keys",
    "apply_overrides",
    "check_trackers",
    "parse_profile_steps",
    "parse_sets",
    "validate_config",
]


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_from_dict(tree: dict[str, Any], source: str = "config") -> Config:
    cfg = Config()
    apply_overrides(cfg, flatten(tree, source), source)
    return cfg


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """YAML file (optional) then dotted-key overrides, then validation."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"config file {str(path)!r} does not exist; pass an existing YAML file"
            )
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(
                f"config file {str(path)!r} must hold a mapping of sections, got {type(tree).__name__}"
            )
        apply_overrides(cfg, flatten(tree, str(path)), str(path))
    apply_overrides(cfg, overrides or {}, "command line")
    validate_config(cfg)
    return cfg


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
