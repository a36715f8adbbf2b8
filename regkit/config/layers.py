"""Configuration files as layers: YAML with line numbers, ``base:`` layering, path resolution and presets.

:func:`read_yaml` reads every YAML file regkit takes (registration configurations, batch specs, the feature network's
training recipes) with safe semantics only, into a :class:`Layer`: the data, and for every key path the file and line
that set it, from which errors are one line ``FILE:LINE: key.path: message``.

A registration configuration (:func:`open_config`, :func:`read_layers`) is a file or the name of a preset shipped with
regkit (:func:`list_presets`: the files of the repository's ``configs/presets/``, installed as ``regkit.presets``); it
may start from another one with ``base: NAME_OR_PATH`` and override keys (:func:`merge`: mappings merge deeply, lists
and scalars replace). Relative paths (the keys of :data:`~regkit.config.schema.PATH_KEYS`) are resolved against the
folder of the YAML file that sets them (:func:`resolve_paths`; overrides given in Python: against the current
directory).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

import yaml

from regkit.config.messages import format_path, show
from regkit.config.schema import PATH_KEYS
from regkit.errors import ConfigError
from regkit.options import KeyPath, did_you_mean

__all__ = [
    "DEFAULT_PRESETS",
    "MAX_YAML_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "Layer",
    "Origin",
    "Source",
    "from_python",
    "list_presets",
    "merge",
    "open_config",
    "parse",
    "presets_folder",
    "read_layers",
    "read_yaml",
    "resolve_paths",
]

# ---------------------------------------------------------------------------------------------------------------------
# YAML with line numbers
# ---------------------------------------------------------------------------------------------------------------------


MAX_YAML_BYTES = 4 * 2**20
"""The largest YAML file regkit reads (4 MiB); configurations take a few kB."""
MAX_YAML_NODES = 100_000
"""The most nodes (keys, values, list items) a YAML document may hold, each alias counted as the nodes it repeats: a
bound on the time and memory of reading it (about 7 s at the limit; an "alias bomb" of a few hundred bytes would
expand to billions). A batch spec of 10,000 explicit jobs holds about 50,000; longer lists belong in its CSV."""
MAX_YAML_DEPTH = 64
"""The deepest nesting of mappings and lists a YAML document may have, aliases expanded (regkit's files nest up to
about ten levels)."""


class _Loader(yaml.SafeLoader):
    """The safe loader, also reading YAML 1.2 floats without a dot (``1e-5``) as floats rather than strings, and
    refusing, as a :class:`ConfigError` ``LABEL:LINE: ...``, what would exhaust memory, time or the stack: recursive
    aliases, more than :data:`MAX_YAML_NODES` nodes and nesting deeper than :data:`MAX_YAML_DEPTH`."""

    def __init__(self, text: str, label: str) -> None:
        super().__init__(text)
        self.label = label
        self.depth = 0  # nodes being composed: the ancestors of the next one
        self.nodes = 0  # nodes composed so far, each alias counted as the nodes it repeats
        self.expanded: dict[int, tuple[int, int]] = {}  # id of a composed node -> (nodes, height), aliases expanded

    def refuse(self, line: int, problem: str) -> NoReturn:
        raise ConfigError(f"{self.label}:{line}: {problem}")

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            node = super().compose_node(parent, index)
            if id(node) not in self.expanded:
                self.refuse(line, f"the alias *{event.anchor} is inside its own anchor (recursive aliases are refused)")
            nodes, height = self.expanded[id(node)]
            if self.depth + height > MAX_YAML_DEPTH:
                self.refuse(line, f"nested more than {MAX_YAML_DEPTH} levels deep once aliases are expanded")
            self.count(nodes, line)
            return node
        if self.depth == MAX_YAML_DEPTH:
            self.refuse(line, f"nested more than {MAX_YAML_DEPTH} levels deep")
        self.depth += 1
        node = super().compose_node(parent, index)
        self.depth -= 1
        pairs_or_nodes = node.value if isinstance(node, yaml.CollectionNode) else []
        children = [n for child in pairs_or_nodes for n in (child if isinstance(child, tuple) else (child,))]
        self.expanded[id(node)] = (
            1 + sum(self.expanded[id(n)][0] for n in children),
            1 + max((self.expanded[id(n)][1] for n in children), default=0),
        )
        self.count(1, line)  # its descendants were counted as they were composed
        return node

    def count(self, nodes: int, line: int) -> None:
        self.nodes += nodes
        if self.nodes > MAX_YAML_NODES:
            self.refuse(line, f"more than {MAX_YAML_NODES} YAML nodes, each alias counted as the nodes it repeats")


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

Origin = tuple[str, int | None]
"""Where a key was set: a file label and a 1-based line (None for overrides given in Python)."""


@dataclass(frozen=True)
class Layer:
    """Raw configuration data and, for every key path in it, where it was set."""

    data: dict[str, Any]
    origins: dict[KeyPath, Origin]


def parse(text: str, label: str) -> Layer:
    """Parse one YAML document into a mapping, recording the line of every key and list item.

    Every problem is a :class:`ConfigError` ``LABEL:LINE: ...``: invalid YAML, unsafe tags, a value its tag cannot
    hold, duplicate or non-string keys, and the limits of :data:`MAX_YAML_NODES` and :data:`MAX_YAML_DEPTH`.
    """
    try:
        loader = _Loader(text, label)
        try:
            node = loader.get_single_node()
            if node is None or node.tag == "tag:yaml.org,2002:null":
                raise ConfigError(f"{label}:1: the configuration is empty")
            if not isinstance(node, yaml.MappingNode):
                kind = "list" if isinstance(node, yaml.SequenceNode) else "single value"
                raise ConfigError(f"{label}:{node.start_mark.line + 1}: expected a mapping of keys, got a {kind}")
            origins: dict[KeyPath, Origin] = {(): (label, node.start_mark.line + 1)}
            return Layer(_construct(loader, node, (), label, origins), origins)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark is not None else 1
        hint = " (indent with spaces, not tabs)" if "\\t" in str(err.problem) else ""
        raise ConfigError(f"{label}:{line}: invalid YAML: {err.problem or err.context}{hint}") from None
    except yaml.reader.ReaderError as err:
        raise ConfigError(f"{label}:{text.count(chr(10), 0, err.position) + 1}: invalid YAML: {err.reason}") from None


def read_yaml(path: Path, label: str, where: str = "", hint: str = "") -> Layer:
    """Read and parse the YAML file ``path``, named ``label`` in messages: the one reader of every YAML file regkit
    takes (configurations, batch specs, training recipes).

    Read errors are one line ``{where}{label}: no such file{hint}`` (or ``LINE: not a UTF-8 text file``, ``larger
    than 4 MiB`` (:data:`MAX_YAML_BYTES`), ``cannot read (REASON)``); ``where`` prefixes them (the ``FILE:LINE: key:``
    that named the file, or nothing), ``hint`` follows a missing file. Parse errors are those of :func:`parse`.
    """
    try:
        with path.open("rb") as file:
            data = file.read(MAX_YAML_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{where}{label}: no such file{hint}") from None
    except OSError as err:
        raise ConfigError(f"{where}{label}: cannot read ({err.strerror})") from None
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(
            f"{where}{label}: larger than {MAX_YAML_BYTES >> 20} MiB, the most regkit reads from a YAML file"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"{where}{label}:{line}: not a UTF-8 text file") from None
    return parse(text, label)


def _scalar(loader: _Loader, node: yaml.Node, path: KeyPath, label: str) -> Any:
    """The Python value of a scalar node (or of a collection with an explicit tag: ``!!set``, ...), safe semantics; a
    value its tag cannot hold (an integer of 5,000 digits, a 13th month) and a string holding a NUL character (which
    no path or name may hold) are a located :class:`ConfigError`."""
    where = f"{label}:{node.start_mark.line + 1}: {format_path(path) or 'top level'}"
    try:
        value = loader.construct_object(node, deep=True)
    except (ValueError, OverflowError) as err:
        raise ConfigError(f"{where}: not a valid {node.tag.rsplit(':', 1)[-1]} ({err})") from None
    if isinstance(value, str) and "\0" in value:
        raise ConfigError(f"{where}: a NUL character (\\0) in {value!r}")
    return value


def _key(loader: _Loader, node: yaml.Node, path: KeyPath, label: str) -> str:
    """The key of a mapping at ``path``, which must be a string."""
    key = _scalar(loader, node, path, label)
    if not isinstance(key, str):
        where = f"{label}:{node.start_mark.line + 1}: {format_path(path) or 'top level'}"
        raise ConfigError(f"{where}: keys must be strings (got {show(key)})")
    return key


def _construct(loader: _Loader, node: yaml.Node, path: KeyPath, label: str, origins: dict[KeyPath, Origin]) -> Any:
    """Build the Python value of ``node`` (safe semantics), rejecting duplicate and non-string keys."""
    if isinstance(node, yaml.MappingNode) and node.tag == "tag:yaml.org,2002:map":
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = _key(loader, key_node, path, label)
            line = key_node.start_mark.line + 1
            if key in seen:
                where = f"{format_path((*path, key))}: duplicate key"
                raise ConfigError(f"{label}:{line}: {where} (first set on line {seen[key]})")
            seen[key] = line
        loader.flatten_mapping(node)  # merged keys (<<) first, then the node's own keys, which override them
        mapping: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = _key(loader, key_node, path, label)
            origins[(*path, key)] = (label, key_node.start_mark.line + 1)
            mapping[key] = _construct(loader, value_node, (*path, key), label, origins)
        return mapping
    if isinstance(node, yaml.SequenceNode) and node.tag == "tag:yaml.org,2002:seq":
        items = []
        for i, item in enumerate(node.value):
            origins[(*path, i)] = (label, item.start_mark.line + 1)
            items.append(_construct(loader, item, (*path, i), label, origins))
        return items
    return _scalar(loader, node, path, label)


def from_python(data: Mapping[str, Any], label: str) -> Layer:
    """A layer from a Python mapping (overrides), every key attributed to ``label`` without a line."""
    origins: dict[KeyPath, Origin] = {}

    def walk(value: Any, path: KeyPath) -> None:
        origins[path] = (label, None)
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, (*path, key))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(item, (*path, i))

    walk(data, ())
    return Layer(dict(data), origins)


def merge(base: Layer, over: Layer) -> Layer:
    """``over`` on top of ``base``: mappings merge key by key, anything else in ``over`` replaces."""
    origins: dict[KeyPath, Origin] = {}

    def subtree(layer: Layer, path: KeyPath) -> None:
        origins.update({p: o for p, o in layer.origins.items() if p[: len(path)] == path})

    def combine(a: Any, b: Any, path: KeyPath) -> Any:
        if not (isinstance(a, Mapping) and isinstance(b, Mapping)):
            subtree(over, path)
            return b
        origins[path] = over.origins[path]
        merged = dict(a)
        for key, value in b.items():
            merged[key] = combine(a[key], value, (*path, key)) if key in a else value
            if key not in a:
                subtree(over, (*path, key))
        for key in a.keys() - b.keys():
            subtree(base, (*path, key))
        return merged

    return Layer(combine(base.data, over.data, ()), origins)


def resolve_paths(value: Any, folder: Path) -> Any:
    """A copy of ``value`` with relative file paths (under the keys in ``PATH_KEYS``) joined to ``folder``."""
    if isinstance(value, Mapping):
        return {
            key: str(folder / Path(item).expanduser())
            if key in PATH_KEYS and isinstance(item, str)
            else resolve_paths(item, folder)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [resolve_paths(item, folder) for item in value]
    return value


# ---------------------------------------------------------------------------------------------------------------------
# Presets and sources
# ---------------------------------------------------------------------------------------------------------------------


DEFAULT_PRESETS = {2: "image-2d", 3: "brain-mri-3d"}
"""The preset front ends use when the user names none, by image dimension (CLI ``register``, the napari widget)."""


def presets_folder() -> Path:
    """The folder of the presets shipped with regkit: the repository's ``configs/presets/``, installed as the package
    ``regkit.presets`` (in an editable install: that folder itself). A checkout used without installing (its root on
    ``PYTHONPATH``) has no ``regkit.presets``; its ``configs/presets/`` is used."""
    checkout = Path(__file__).resolve().parents[2] / "configs" / "presets"
    if importlib.util.find_spec("regkit.presets") is None and checkout.is_dir():
        return checkout
    return Path(str(resources.files("regkit.presets")))


def list_presets() -> list[str]:
    """Names of the registration presets shipped with regkit (``configs/presets/NAME.yaml``), sorted."""
    return sorted(p.stem for p in presets_folder().glob("*.yaml"))


@dataclass(frozen=True)
class Source:
    """A configuration file: its label in messages, its resolved path, its parsed layer, and the folder of its
    relative paths."""

    label: str
    path: Path
    layer: Layer
    folder: Path


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a file; False also where the name cannot be looked up (too long, say)."""
    try:
        return path.is_file()
    except OSError:
        return False


def open_config(ref: str | Path, folder: Path, where: str) -> Source:
    """Find, read and parse a configuration: a preset name, or a YAML path relative to ``folder``.

    ``where`` prefixes error messages (the ``FILE:LINE: base:`` that named ``ref``, or nothing).
    """
    presets = list_presets()
    is_path = isinstance(ref, Path) or ref.endswith((".yaml", ".yml")) or "/" in ref or "\\" in ref
    if not is_path and ref in presets:
        path = presets_folder() / f"{ref}.yaml"
        label = f"configs/presets/{ref}.yaml"
    else:
        path = folder / Path(ref).expanduser()
        label = str(ref) if Path(ref).is_absolute() or folder == Path() else str(path)
        if not is_path and not _is_file(path):
            raise ConfigError(
                f"{where}{ref!r} is neither a YAML file nor a preset{did_you_mean(str(ref), presets)} "
                f"(presets: {', '.join(presets)})"
            )
    return Source(label, path.resolve(), read_yaml(path, label, where), path.parent.absolute())


def read_layers(source: Source, chain: tuple[Path, ...]) -> Layer:
    """The layer of ``source`` merged on top of the layers of its ``base`` chain (``chain``: the files below it)."""
    layer = source.layer
    data = resolve_paths(layer.data, source.folder)
    if "base" not in data:
        return Layer(data, layer.origins)
    ref = data.pop("base")
    label, line = layer.origins[("base",)]
    where = f"{label}:{line}: base: "
    if not isinstance(ref, str):
        raise ConfigError(f"{where}expected a preset name or a file path, got {show(ref)}")
    base = open_config(ref, source.folder, where)
    chain = (*chain, source.path)
    if base.path in chain:
        raise ConfigError(f"{where}circular base {ref!r}")
    origins = {path: origin for path, origin in layer.origins.items() if path[:1] != ("base",)}
    return merge(read_layers(base, chain), Layer(data, origins))
