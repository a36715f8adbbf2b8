"""Shared helpers of the configuration tests: writing a YAML file, and the one-line error of loading one."""

from __future__ import annotations

from pathlib import Path

import pytest

from regkit.config import load_config
from regkit.errors import ConfigError


def write_yaml(folder: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def config_error(source: str | Path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message
