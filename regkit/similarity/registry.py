"""The registry of similarity measures: name -> options model and measure class, and :func:`build_similarity`.

:data:`SIMILARITIES` is the one list of measures: the configuration's ``similarity:`` union
(:data:`regkit.config.AnySimilarity`) is generated from its options models, in its order, and
:func:`build_similarity` builds its measure classes. Adding a measure: its options model in
:mod:`regkit.similarity.options`, its ``Similarity`` subclass in a module of its own, and one entry here.

This module does not import torch: a measure's module is imported when the measure is first built.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from regkit.errors import ConfigError
from regkit.options import did_you_mean
from regkit.similarity.options import (
    FeaturesSimilarity,
    LnccSimilarity,
    MiSimilarity,
    MseSimilarity,
    NccSimilarity,
    SimilarityOptions,
)

if TYPE_CHECKING:
    from regkit.similarity.base import Similarity

__all__ = ["SIMILARITIES", "Measure", "build_similarity", "register_similarity"]


@dataclass(frozen=True)
class Measure:
    """A similarity measure: its options model (the configuration's schema) and its ``Similarity`` subclass, named
    by module and class (imported on first use)."""

    options: type[SimilarityOptions]
    module: str
    class_name: str

    def measure_class(self) -> type[Similarity]:
        """The measure's ``Similarity`` subclass (importing its module)."""
        cls: type[Similarity] = getattr(importlib.import_module(self.module), self.class_name)
        return cls


SIMILARITIES: dict[str, Measure] = {
    "mse": Measure(MseSimilarity, "regkit.similarity.mse", "MeanSquaredError"),
    "ncc": Measure(NccSimilarity, "regkit.similarity.ncc", "NormalizedCrossCorrelation"),
    "lncc": Measure(LnccSimilarity, "regkit.similarity.lncc", "LocalNormalizedCrossCorrelation"),
    "mi": Measure(MiSimilarity, "regkit.similarity.mi", "MutualInformation"),
    "features": Measure(FeaturesSimilarity, "regkit.similarity.features", "FeatureSimilarity"),
}
"""Similarity measure name (the configuration's ``similarity.name``) -> :class:`Measure`, in the schema's order."""


def register_similarity(name: str, measure: Measure) -> None:
    """Add ``measure`` to :data:`SIMILARITIES` as ``name`` (ValueError if taken), for :func:`build_similarity`; the
    configuration schema, generated when :mod:`regkit.config` is imported, offers only the measures listed above."""
    if name in SIMILARITIES:
        raise ValueError(f"similarity '{name}' is already registered by {SIMILARITIES[name].class_name}")
    SIMILARITIES[name] = measure


def build_similarity(name: str, **params: object) -> Similarity:
    """Build the similarity registered as ``name`` with keyword ``params``; ConfigError for unknown names/parameters."""
    if name not in SIMILARITIES:
        known = ", ".join(sorted(SIMILARITIES))
        raise ConfigError(f"unknown similarity '{name}'{did_you_mean(name, SIMILARITIES)} (known: {known})")
    cls = SIMILARITIES[name].measure_class()
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for key in params:
        if key not in accepted:
            raise ConfigError(
                f"similarity '{name}' has no parameter '{key}'{did_you_mean(key, accepted)} "
                f"(parameters: {', '.join(accepted) or 'none'})"
            )
    return cls(**params)
