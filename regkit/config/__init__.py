"""Registration configuration: a typed, strictly validated schema, loaded from YAML files or named presets.

A configuration is a :class:`RegistrationConfig`: global settings (dimension, device, backend, seed, dtype), an ordered
list of stages (``moments``, ``rigid``, ``affine``, ``cpab``) and the optional outputs to write. Every model is frozen
and rejects unknown keys; numbers are not parsed from strings (an int is accepted where a float is expected).

YAML is read with safe semantics only. :func:`load_config` takes a file or the name of a preset shipped with regkit
(``configs/presets/NAME.yaml``, see :func:`list_presets`); a file may start from another one with
``base: NAME_OR_PATH`` and override keys (mappings merge deeply, lists and scalars replace). Relative paths are
resolved against the folder of the YAML file that sets them (overrides given in Python: against the current
directory). Every problem raises a :class:`~regkit.errors.ConfigError` with one line ``FILE:LINE: key.path: message``.

The stage types and the similarity measures are discriminated unions (:data:`Stage` on ``type``,
:data:`AnySimilarity` on ``name``); :data:`STAGES` maps each stage type to its model, :data:`SIMILARITIES` (the
similarity registry, :mod:`regkit.similarity`) each measure name to its options model and measure class.

Modules: :mod:`~regkit.config.schema` (the models), :mod:`~regkit.config.layers` (YAML with line numbers, ``base:``
layering, paths, presets), :mod:`~regkit.config.messages` (validation errors as one line) and
:mod:`~regkit.config.files` (load, dump, hash).
"""

from __future__ import annotations

# --- configuration files: load, dump, hash ---------------------------------------------------------------------------
from regkit.config.files import config_hash, default_config, dump_config, load_config

# --- presets ---------------------------------------------------------------------------------------------------------
from regkit.config.layers import DEFAULT_PRESETS, list_presets

# --- the schema: the whole configuration, its stages and their parts ------------------------------------------------
from regkit.config.schema import (
    STAGES,
    AffineStage,
    AnySimilarity,
    CpabPrior,
    CpabStage,
    MaskConfig,
    MomentsStage,
    OptimizerConfig,
    OutputsConfig,
    PyramidLevel,
    RegistrationConfig,
    RigidStage,
    Stage,
)

# --- the similarity measures' options (the registry of regkit.similarity) -------------------------------------------
from regkit.similarity.options import (
    FeaturesSimilarity,
    LnccSimilarity,
    MiSimilarity,
    MseSimilarity,
    NccSimilarity,
    SimilarityOptions,
)
from regkit.similarity.registry import SIMILARITIES

__all__ = [
    "DEFAULT_PRESETS",
    "SIMILARITIES",
    "STAGES",
    "AffineStage",
    "AnySimilarity",
    "CpabPrior",
    "CpabStage",
    "FeaturesSimilarity",
    "LnccSimilarity",
    "MaskConfig",
    "MiSimilarity",
    "MomentsStage",
    "MseSimilarity",
    "NccSimilarity",
    "OptimizerConfig",
    "OutputsConfig",
    "PyramidLevel",
    "RegistrationConfig",
    "RigidStage",
    "SimilarityOptions",
    "Stage",
    "config_hash",
    "default_config",
    "dump_config",
    "list_presets",
    "load_config",
]
