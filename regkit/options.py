"""Strict options models: the base class and shared field types of every schema read from YAML.

The registration configuration (:mod:`regkit.config`), the similarity measures' options (:mod:`regkit.similarity`),
the batch spec (:mod:`regkit.batch.spec`) and the feature network's training configuration
(:mod:`regkit.features.train_config`) are all built on :class:`Model`: frozen, strict (numbers are not parsed from
strings; an int is accepted where a float is expected), unknown keys rejected with a suggestion.

Validators raise :func:`invalid`, whose message and key path :func:`regkit.config.messages.first_error` turns into one
line ``FILE:LINE: key.path: message``. This module sits below both :mod:`regkit.config` and :mod:`regkit.similarity`
(the configuration's similarity union is generated from the similarity registry, whose options models are built on
:class:`Model`), so it imports neither.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

__all__ = ["INVALID", "KeyPath", "Model", "Seq", "did_you_mean", "invalid"]

KeyPath = tuple[str | int, ...]
"""A key path in the raw data: mapping keys and list indices, e.g. ``('stages', 2, 'optimizer')``."""

INVALID = "regkit_config"
"""The pydantic error type of :func:`invalid`."""

T = TypeVar("T")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'CHOICE'?"`` for the choice closest to ``word``, or ``""`` when none is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


def invalid(message: str, key: KeyPath = ()) -> PydanticCustomError:
    """A validation error whose location is the validated object's location followed by ``key``."""
    return PydanticCustomError(INVALID, "{message}", {"message": message, "key": key})


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


Seq = Annotated[tuple[T, ...], BeforeValidator(_as_tuple)]
"""A tuple that also accepts a list (YAML sequences), its items validated strictly."""


class Model(BaseModel):
    """Base of every options model: frozen, strict, unknown keys rejected with a suggestion."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    raise invalid(f"unknown key {key!r}{did_you_mean(str(key), cls.model_fields)}", (key,))
        return data
