"""Settings from a YAML file (`--config`), with flags given on the command line taking precedence.

The file holds the same keys as the flags, spelt either way (`block_size` or `block-size`),
at the top level or nested under `engine_args:` as in vLLM-style configs:

    engine_args:
      max_num_seqs: 256
      block_size: 32
      gpu_memory_utilization: 0.9
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

ENGINE_SECTION = "engine_args"


def load_config_file(path: str | Path, known_keys: Collection[str]) -> dict[str, Any]:
    """The file's settings as {flag_dest: value}; raises ValueError naming any key it does not know."""
    with open(path, encoding="utf-8") as file:
        try:
            document = yaml.safe_load(file)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    if document is None:
        return {}
    if not isinstance(document, Mapping):
        raise ValueError(f"{path}: expected a mapping of settings, got {type(document).__name__}")
    document = dict(document)
    nested = document.pop(ENGINE_SECTION, None) or {}
    if not isinstance(nested, Mapping):
        raise ValueError(f"{path}: {ENGINE_SECTION} must be a mapping, got {type(nested).__name__}")
    settings: dict[str, Any] = {}
    for raw_key, value in [*document.items(), *nested.items()]:
        key = str(raw_key).replace("-", "_")
        if key not in known_keys:
            raise ValueError(f"{path}: unknown key {raw_key!r}; known keys: {', '.join(sorted(known_keys))}")
        if key in settings:
            raise ValueError(f"{path}: key {raw_key!r} is given twice")
        settings[key] = value
    return settings


def merge_config(config_path: str | Path | None, cli_values: Mapping[str, Any],
                 known_keys: Collection[str]) -> dict[str, Any]:
    """File settings overridden by the flags given on the command line.

    cli_values must hold only flags the user actually gave (argparse defaults suppressed),
    or a default would silently override the file; missing keys take the defaults of the
    settings classes they end up in.
    """
    file_values = load_config_file(config_path, known_keys) if config_path is not None else {}
    return {**file_values, **cli_values}
