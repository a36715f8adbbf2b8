"""Registration configuration files: :func:`load_config` (read, layer, validate), :func:`default_config`,
:func:`dump_config` and :func:`config_hash`."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from regkit.config.layers import DEFAULT_PRESETS, from_python, merge, open_config, read_layers, resolve_paths
from regkit.config.messages import validate
from regkit.config.schema import RegistrationConfig
from regkit.errors import ConfigError

__all__ = ["config_hash", "default_config", "dump_config", "load_config"]


def load_config(source: str | Path, overrides: Mapping[str, Any] | None = None) -> RegistrationConfig:
    """Load and validate a registration configuration.

    ``source`` is a YAML file or the name of a preset (see :func:`list_presets`); a string ending in ``.yaml``/``.yml``
    or containing a path separator is always a file. ``overrides`` is a nested mapping merged on top (mappings merge
    deeply, lists and scalars replace), with relative paths resolved against the current directory. Raises
    :class:`~regkit.errors.ConfigError` with one line ``FILE:LINE: key.path: message`` on any problem.
    """
    layer = read_layers(open_config(source, Path(), ""), ())
    if overrides:
        layer = merge(layer, from_python(resolve_paths(overrides, Path.cwd()), "overrides"))
    return validate(RegistrationConfig, layer)


def default_config(ndim: int) -> RegistrationConfig:
    """The configuration regkit runs on ``ndim``-D images when the user names none: the preset
    :data:`~regkit.config.layers.DEFAULT_PRESETS` ``[ndim]`` (the CLI, the Python API, batch and napari)."""
    if ndim not in DEFAULT_PRESETS:
        raise ConfigError(f"regkit registers 2D and 3D images, not {ndim}D")
    return load_config(DEFAULT_PRESETS[ndim])


class _Dumper(yaml.SafeDumper):
    """The safe dumper, writing lists of scalars on one line (``[4, 8, 12]``) and everything else as blocks."""


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flow = all(not isinstance(item, list | dict) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _represent_list)


def dump_config(cfg: RegistrationConfig) -> str:
    """The configuration as YAML with every default filled in, in schema order; :func:`load_config` reads it back."""
    return yaml.dump(cfg.model_dump(mode="json"), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)


def config_hash(cfg: RegistrationConfig) -> str:
    """A stable hexadecimal SHA-256 of the configuration (of its canonical :func:`dump_config` text)."""
    return hashlib.sha256(dump_config(cfg).encode("utf-8")).hexdigest()
