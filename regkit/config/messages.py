"""Validation errors as one line ``FILE:LINE: key.path: message``.

:func:`first_error` turns a pydantic :class:`~pydantic.ValidationError` of a :class:`~regkit.config.layers.Layer`'s
data into the message of its first error by file position, with the file and line that set the offending key (or its
nearest parent) and ``(and N more)``; :func:`validate` validates a layer with it. Suggestions come from
:func:`regkit.options.did_you_mean`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from regkit.config.schema import UNIONS
from regkit.errors import ConfigError
from regkit.options import INVALID, KeyPath, did_you_mean

if TYPE_CHECKING:
    from regkit.config.layers import Layer

__all__ = ["first_error", "format_path", "show", "validate"]

M = TypeVar("M", bound=BaseModel)

_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "tuple_type": "a list",
    "list_type": "a list",
    "model_type": "a mapping",
    "dict_type": "a mapping",
    "model_attributes_type": "a mapping",
}
_BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def show(value: Any) -> str:
    """A short description of a raw YAML value for messages: its kind, and the value when it is a scalar."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), type(value).__name__
    )
    return f"{kind} {value!r}"


def format_path(path: KeyPath) -> str:
    """``('stages', 2, 'optimizer')`` -> ``stages[2].optimizer``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".")


def _data_path(loc: tuple[Any, ...], data: Any, missing: bool) -> KeyPath:
    """The key path in the raw data of a pydantic error location, without the union tags pydantic adds to it."""
    path: list[str | int] = []
    for i, part in enumerate(loc):
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, list | tuple) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        elif not (missing and i == len(loc) - 1):
            continue
        path.append(part)
    return tuple(path)


def _quoted(text: str) -> list[str]:
    return re.findall(r"'([^']*)'", text)


def _message(err: Any) -> tuple[KeyPath, str]:
    """A pydantic error as (key path to append to its location, message)."""
    kind, ctx, value = err["type"], err.get("ctx", {}), err["input"]
    if kind == INVALID:
        return ctx["key"], ctx["message"]
    if kind == "missing":
        return (), "required key missing"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        key = ctx["discriminator"].strip("'")
        tags = ", ".join(UNIONS[key])
        if kind == "union_tag_not_found":
            return (key,), f"required key missing (one of {tags})"
        return (key,), f"unknown {key} {ctx['tag']!r}{did_you_mean(ctx['tag'], UNIONS[key])} (one of {tags})"
    if kind == "literal_error":
        hint = did_you_mean(value, _quoted(ctx["expected"])) if isinstance(value, str) else ""
        return (), f"must be {ctx['expected']} (got {show(value)}){hint}"
    if kind in _BOUNDS:
        name, op = _BOUNDS[kind]
        bound = ctx[name]
        shown = str(bound) if isinstance(bound, int) else f"{bound:g}"
        return (), f"must be {op} {shown} (got {value!r})"
    if kind in _EXPECTED:
        return (), f"expected {_EXPECTED[kind]}, got {show(value)}"
    if kind == "finite_number":
        return (), f"must be a finite number (got {value!r})"
    return (), err["msg"]


def first_error(err: ValidationError, layer: Layer) -> str:
    """The first validation error, by file position, as ``FILE:LINE: key.path: message (and N more)``."""
    located = []
    for e in err.errors(include_url=False):
        key, message = _message(e)
        path = _data_path(e["loc"], layer.data, e["type"] == "missing") + tuple(key)
        label, line = layer.origins[next(path[:n] for n in range(len(path), -1, -1) if path[:n] in layer.origins)]
        located.append((line is None, line or 0, f"{label}:{line}" if line is not None else label, path, message))
    located.sort(key=lambda item: item[:2])
    _, _, where, path, message = located[0]
    more = f" (and {len(located) - 1} more)" if len(located) > 1 else ""
    return f"{where}: {format_path(path) or 'top level'}: {message}{more}"


def validate(model: type[M], layer: Layer) -> M:
    """``model`` validated from ``layer``'s data; :class:`~regkit.errors.ConfigError` with :func:`first_error`."""
    try:
        return model.model_validate(layer.data)
    except ValidationError as err:
        raise ConfigError(first_error(err, layer)) from None
