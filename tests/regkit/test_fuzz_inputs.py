"""Fuzzing the loaders of user files: registration configurations (YAML), batch specs (YAML and their CSV) and
``transform.json``.

Each loader gets a few hundred variants of valid files, mutated by a generator with a fixed seed: text edits (cuts,
repeated spans, hostile tokens, huge or non-finite numbers, invalid UTF-8, anchors and aliases, deep nesting) and edits
of the parsed data (wrong types, missing and unknown keys, wrong lengths, nested junk). Every variant must load (into
a valid object) or raise a :class:`~regkit.errors.RegkitError` whose message is one line naming the file; any other
exception is a bug. A failure lists the first variants that broke the rule, by name, so that one can be replayed.
"""

from __future__ import annotations

import copy
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from regkit.batch import load_spec
from regkit.config import load_config
from regkit.config.layers import presets_folder
from regkit.cpab.module import CPAB
from regkit.errors import RegkitError
from regkit.spatial.grid import Grid
from regkit.transform import MAX_STEPS, MAX_THETA, Transformation
from tests.regkit.batch.batch_cases import LIST_SPEC, make_data

VARIANTS = 300
FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml, where PyYAML has it: for making the variants
FAST_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

# --- the mutations ---------------------------------------------------------------------------------------------------

HOSTILE_TOKENS = [
    ":",
    "- ",
    "{",
    "}",
    "[",
    "]",
    ",",
    "&a ",
    "*a",
    "*b",
    "<<: *a",
    "? ",
    "#",
    "|",
    "> ",
    "!",
    "'",
    '"',
    "%",
    "@",
    "`",
    "\t",
    "\n",
    "\n  ",
    "---\n",
    "...\n",
    "%YAML 1.1\n",
    "%TAG ! tag:x,2000:\n",
    "\x00",
    "\x07",
    "\u202e",
    "\ufeff",
    "!!python/object/apply:os.getpid []",
    "!!python/name:os.system",
    "!!binary '%%%'",
    "!!set {a: 1}",
    "!!omap [a: 1, a: 2]",
    "!!pairs [[1, 2]]",
    "!!timestamp x",
    "!!int abc",
    "!!float abc",
    "!!str",
    "!!map [1]",
    "2001-13-45",
    "2001-02-30 25:61:61",
    "1" * 5000,
    "1e999",
    "-1e999",
    ".nan",
    "-.inf",
    "0x",
    "0o9",
    "0b2",
    "1_000",
    "190:20:30",
    "~",
    "null",
    "yes",
    "off",
    "'" + "a" * 20000 + "'",
    '"\\x"',
    '"\\uD800"',
    "? [a, b]\n",
    "{a: 1, a: 2}",
    "{" * 300 + "}" * 300,
    "[" * 300 + "]" * 300,
    "- " * 300 + "1",
    "&x [*x]",
    "&y {k: *y}",
    "{a: &z [1], b: *z}",
]
HOSTILE_VALUES = [
    "-1",
    "0",
    "1e30",
    "-1e308",
    "1e-320",
    ".inf",
    ".nan",
    "99999999999999999999999",
    "1" * 5000,
    "''",
    "'x'",
    "[]",
    "{}",
    "[[[[1]]]]",
    "{a: {b: {c: {}}}}",
    "null",
    "true",
    "2001-13-45",
    "!!binary AAAA",
    "'../../../etc'",
    "'/dev/zero'",
    "'" + "x" * 300 + "'",
    "*a",
    "&a 1",
    "!!set {x}",
    '"\\0"',
]
INVALID_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3(", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"]
JUNK_DATA: list[Any] = [
    None,
    True,
    False,
    -1,
    0,
    1,
    10**30,
    -(10**30),
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    "x" * 1000,
    "float64",
    [],
    {},
    [1, [2, [3]]],
    {"a": {"b": {}}},
    [None],
    [float("nan")] * 3,
    [1e30, 1e30],
    ["1", "2"],
]


def alias_bomb(levels: int, width: int) -> str:
    """Billion laughs as one flow list: each of ``levels`` anchored lists holds ``width`` aliases of the one before."""
    lists = [f"&l0 [{', '.join(['x'] * width)}]"]
    lists += [f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return f"[{', '.join(lists)}]"


def deep(levels: int, kind: str) -> str:
    """A YAML value nested ``levels`` deep: flow lists, flow mappings or (starting on a new line) block lists."""
    if kind == "list":
        return "[" * levels + "]" * levels
    if kind == "map":
        return "{a: " * levels + "1" + "}" * levels
    return "".join("\n" + "  " * (i + 1) + "-" for i in range(levels)) + " 1"


def mutate_text(rng: random.Random, text: bytes) -> tuple[str, bytes]:
    """One random text-level edit of ``text``: ``(description, edited bytes)``."""
    n = len(text)
    at, span = rng.randrange(n + 1), rng.randrange(1, 40)
    kind = rng.randrange(9)
    if kind == 0:
        return f"cut at {at}", text[:at]
    if kind == 1:
        return f"delete {span} at {at}", text[:at] + text[at + span :]
    if kind == 2:
        return f"repeat {span} at {at}", text[:at] + text[at : at + span] * rng.randrange(2, 6) + text[at:]
    if kind == 3:
        token = rng.choice(HOSTILE_TOKENS)
        return f"insert {token[:20]!r} at {at}", text[:at] + token.encode() + text[at:]
    if kind == 4:
        junk = rng.choice(INVALID_UTF8)
        return f"insert {junk!r} at {at}", text[:at] + junk + text[at:]
    if kind == 5:
        scalars = list(re.finditer(rb"(?<=: )[^\s{}\[\],#]+", text))
        if scalars:
            match, value = rng.choice(scalars), rng.choice(HOSTILE_VALUES)
            return f"value {match.group()!r} -> {value[:20]!r}", text[: match.start()] + value.encode() + text[
                match.end() :
            ]
    lines = text.split(b"\n")
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    if kind == 6:
        lines[i], lines[j] = lines[j], lines[i]
        return f"swap lines {i + 1} and {j + 1}", b"\n".join(lines)
    if kind == 7:
        shift = rng.choice([-4, -2, -1, 1, 2, 4])
        line = lines[i]
        lines[i] = b" " * shift + line if shift > 0 else line[-shift:]
        return f"indent line {i + 1} by {shift}", b"\n".join(lines)
    token = rng.choice(HOSTILE_TOKENS)
    lines[i] = token.encode()
    return f"line {i + 1} -> {token[:20]!r}", b"\n".join(lines)


def hostile_documents() -> list[str]:
    """Flow-style YAML values that attack the loader: alias bombs, recursive aliases and merges, deep nesting."""
    bombs = [alias_bomb(levels, width) for levels, width in ((9, 9), (6, 10), (4, 4), (30, 2))]
    recursive = ["&x [*x]", "&y {k: *y}", "&m {<<: *m}", "&p [1, {a: *p}]", "[&q {a: 1}, {<<: [*q, *q]}]"]
    nested = [deep(levels, kind) for levels in (20, 70, 200, 500) for kind in ("list", "map", "block")]
    return bombs + recursive + nested


def insert_hostile(rng: random.Random, text: bytes) -> tuple[str, bytes]:
    """``text`` with a hostile document (:func:`hostile_documents`) under a new top-level key or (flow values only)
    as the value of a random key."""
    document = rng.choice(hostile_documents())
    scalars = list(re.finditer(rb"(?<=: )[^\s{}\[\],#&*]+$", text, re.MULTILINE))
    if "\n" in document or not scalars or rng.random() < 0.5:
        name = f"x{rng.randrange(100)}"
        return f"{name}: {document[:30]!r}", text + f"\n{name}: {document}\n".encode()
    match = rng.choice(scalars)
    return f"value {match.group()!r} -> {document[:30]!r}", text[: match.start()] + document.encode() + text[
        match.end() :
    ]


def leaves(value: Any, path: tuple = ()) -> list[tuple]:
    """Every key path into ``value`` (mappings and lists), the containers' own paths included."""
    paths = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            paths += leaves(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            paths += leaves(item, (*path, i))
    return paths


def mutate_data(rng: random.Random, data: dict) -> tuple[str, dict]:
    """One random edit of parsed data: replace, delete, add, wrap, shorten or lengthen at a random key path."""
    data = copy.deepcopy(data)
    path = rng.choice(leaves(data)[1:])
    *head, last = path
    parent = data
    for part in head:
        parent = parent[part]
    kind = rng.randrange(6)
    if kind == 0 or not isinstance(parent, dict | list):
        junk = copy.deepcopy(rng.choice(JUNK_DATA))
        parent[last] = junk
        return f"{path} -> {str(junk)[:30]}", data
    if kind == 1:
        del parent[last]
        return f"delete {path}", data
    if kind == 2:
        target = parent[last]
        if isinstance(target, dict):
            target[rng.choice(["extra", "base", "format", "type", "<<"])] = copy.deepcopy(rng.choice(JUNK_DATA))
            return f"add a key at {path}", data
        parent[last] = [target]
        return f"wrap {path} in a list", data
    if kind == 3:
        parent[last] = {"nested": parent[last]}
        return f"wrap {path} in a mapping", data
    target = parent[last]
    if isinstance(target, list) and target:
        if kind == 4:
            parent[last] = target[:-1]
            return f"shorten {path}", data
        parent[last] = [*target, copy.deepcopy(target[-1])]
        return f"lengthen {path}", data
    parent[last] = copy.deepcopy(rng.choice(JUNK_DATA))
    return f"{path} -> junk", data


def problem(load: Callable[[Path], object], path: Path, names: tuple[str, ...]) -> str | None:
    """None when ``load(path)`` returns or raises a one-line RegkitError naming one of ``names``; else the problem."""
    try:
        load(path)
    except RegkitError as err:
        message = str(err)
        if "\n" in message:
            return f"a message of {message.count(chr(10)) + 1} lines: {message[:200]!r}"
        if not any(name in message for name in names):
            return f"a message naming no file: {message[:200]!r}"
        return None
    except Exception as err:  # the fuzzer reports every other exception as a bug
        return f"{type(err).__name__}: {str(err)[:200]}"
    return None


def run_variants(
    variants: list[tuple[str, bytes]], path: Path, load: Callable[[Path], object], names: tuple[str, ...]
) -> list[str]:
    """Write each variant to ``path`` and load it; the variants that broke the rule, described."""
    broken = []
    for name, content in variants:
        path.write_bytes(content)
        found = problem(load, path, names)
        if found is not None:
            broken.append(f"{name}: {found}")
    return broken


def assert_none_broken(broken: list[str], total: int) -> None:
    assert not broken, f"{len(broken)} of {total} variants broke the rule, e.g.:\n" + "\n".join(broken[:8])


def yaml_variants(rng: random.Random, seeds: list[str], count: int) -> list[tuple[str, bytes]]:
    """``count`` mutations of the YAML ``seeds``: a third edits of the parsed data (dumped again), a third text edits
    (one to three of each), a third one hostile document inserted."""
    parsed = [yaml.load(seed, Loader=FAST_LOADER) for seed in seeds]
    variants = []
    for i in range(count):
        seed = rng.randrange(len(seeds))
        text, data = seeds[seed].encode(), parsed[seed]
        steps = []
        for _ in range(1 if i % 3 == 2 else rng.randrange(1, 4)):
            if i % 3 == 0:
                step, data = mutate_data(rng, data)
                text = yaml.dump(data, Dumper=FAST_DUMPER, allow_unicode=True, width=200).encode()
            elif i % 3 == 1:
                step, text = mutate_text(rng, text)
            else:
                step, text = insert_hostile(rng, text)
            steps.append(step)
        variants.append((f"variant {i} of seed {seed} ({'; '.join(steps)})", text))
    return variants


# --- registration configurations -------------------------------------------------------------------------------------

ANCHORED_CONFIG = """\
base: quick-2d
seed: 3
stages:
  - type: affine
    similarity: &sim {name: ncc}
    optimizer: &opt {learning_rate: 0.1, iterations: 5, tolerance: 1e-6}
  - type: cpab
    similarity: *sim
    optimizer: {<<: *opt, iterations: 3}
    tessellation: [2, 4]
    pyramid: [{shrink: 2, smoothing: 1.0}, {shrink: 1, smoothing: 0.0}]
outputs: {qc_png: false}
"""


def test_fuzzed_config_files_load_or_fail_in_one_line(tmp_path):
    seeds = [p.read_text() for p in sorted(presets_folder().glob("*.yaml"))] + [ANCHORED_CONFIG]
    variants = yaml_variants(random.Random(26), seeds, VARIANTS)
    path = tmp_path / "cfg.yaml"
    assert_none_broken(run_variants(variants, path, load_config, (str(path),)), len(variants))


# --- batch specs and their CSV ---------------------------------------------------------------------------------------

SPEC_SEEDS = [
    LIST_SPEC,
    "defaults: {base: tiny.yaml, seed: 2}\noutput: out\nlayout: '{out}/{index}_{moving_parent}'\ncsv: pairs.csv\n",
    "output: out\nlayout: '{out}/{fixed_stem}/{moving_stem}'\nglob: {pairing: atlas, atlas: data/a.nii.gz, images: "
    "'data/*.nii.gz'}\ndefaults: tiny.yaml\n",
    "defaults: &d tiny.yaml\noutput: out\nglob:\n  pairing: pattern\n  fixed: 'data/a*.nii.gz'\n  moving: "
    "'data/b*.nii.gz'\njobs:\n  - {fixed: data/a.nii.gz, moving: data/c.nii.gz, config: *d}\n",
]
CSV_SEED = b"fixed,moving,moving_labels\ndata/a.nii.gz,data/b.nii.gz,\ndata/b.nii.gz,data/c.nii.gz,data/a.nii.gz\n"
HOSTILE_LAYOUTS = [
    "{out}/{index:>500000000}",
    "{out}/{index:099999999d}",
    "{out}/{fixed_stem!r}",
    "{out}/{out.parent}",
    "{out}/{",
    "{out}/}",
    "{out}/{}",
    "{out}/{0}",
    "{out}/../x",
    "{out}/..",
    "{out}",
    "/tmp/x",
    "{out}/" + "x" * 300,
    "{out}/{moving_stem:{out}}",
    "{out}/{fixed_stem[0]}",
    "{out}/a/" * 600 + "{index}",
    "{out}/\x00",
]


def spec_variants(rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    """Mutated specs, a quarter of them with a hostile layout."""
    variants = yaml_variants(rng, SPEC_SEEDS, count - count // 4)
    for i in range(count // 4):
        layout = rng.choice(HOSTILE_LAYOUTS)
        variants.append((f"layout {i}: {layout[:40]!r}", f"{LIST_SPEC}layout: {json.dumps(layout)}\n".encode()))
    return variants


def test_fuzzed_batch_specs_load_or_fail_in_one_line(tmp_path):
    make_data(tmp_path)
    (tmp_path / "pairs.csv").write_bytes(CSV_SEED)
    variants = spec_variants(random.Random(27), VARIANTS)
    path = tmp_path / "batch.yaml"
    names = (str(path), str(tmp_path / "tiny.yaml"), str(tmp_path / "pairs.csv"))
    assert_none_broken(run_variants(variants, path, load_spec, names), len(variants))
    assert not (tmp_path / "out").exists()


def test_fuzzed_batch_csvs_load_or_fail_in_one_line(tmp_path):
    make_data(tmp_path)
    spec = tmp_path / "batch.yaml"
    spec.write_text("defaults: tiny.yaml\noutput: out\ncsv: pairs.csv\n")
    rng = random.Random(28)
    variants = []
    for i in range(VARIANTS // 3):
        name, text = mutate_text(rng, CSV_SEED)
        variants.append((f"variant {i} ({name})", text))
    path = tmp_path / "pairs.csv"
    assert_none_broken(run_variants(variants, path, lambda _: load_spec(spec), (str(path), str(spec))), len(variants))


# --- transform.json --------------------------------------------------------------------------------------------------

NUMBER = re.compile(rb"-?\d+(\.\d+)?(e-?\d+)?")
JSON_TOKENS = [b"NaN", b"Infinity", b"-Infinity", b"1" * 5000, b"1e400", b"[" * 100000, b"{}", b"null", b'"x"', b","]


def transform_seed(ndim: int) -> dict:
    """A valid transformation's ``to_dict``: an oblique fixed grid, a linear part and a CPAB flow with random theta."""
    angle = 0.3
    rotation = np.eye(ndim)
    rotation[:2, :2] = [[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]]
    grid = Grid.create((12, 10, 8)[:ndim], (1.5, 1.0, 2.0)[:ndim], (3.0, -2.0, 1.0)[:ndim], rotation)
    flow = CPAB.for_grid(grid, (2, 3, 2)[:ndim], steps=5)
    with torch.no_grad():
        flow.theta.copy_(torch.randn(flow.theta.shape, generator=torch.Generator().manual_seed(ndim)))
    matrix = np.eye(ndim + 1)
    matrix[:ndim, :ndim] += 0.05
    matrix[:ndim, ndim] = 1.5
    return Transformation(grid, matrix, [flow]).to_dict()


def transform_variants(rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    """Mutations of a 2D and a 3D transform.json: half of the parsed data, half of the text."""
    seeds = {ndim: transform_seed(ndim) for ndim in (2, 3)}
    variants = []
    for i in range(count):
        ndim = 2 + i % 2
        if i % 4 < 2:
            steps = []
            data = seeds[ndim]
            for _ in range(rng.randrange(1, 4)):
                step, data = mutate_data(rng, data)
                steps.append(step)
            variants.append((f"variant {i} ({ndim}D; {'; '.join(steps)})", json.dumps(data).encode()))
            continue
        text = json.dumps(seeds[ndim], indent=1).encode()
        numbers = list(NUMBER.finditer(text))
        kind = rng.randrange(3)
        if kind == 0:
            match, token = rng.choice(numbers), rng.choice(JSON_TOKENS)
            name, text = (
                f"number {match.group()!r} -> {token[:10]!r}",
                text[: match.start()] + token + text[match.end() :],
            )
        elif kind == 1:
            at, junk = rng.randrange(len(text) + 1), rng.choice(INVALID_UTF8 + JSON_TOKENS)
            name, text = f"insert {junk[:10]!r} at {at}", text[:at] + junk + text[at:]
        else:
            name, text = mutate_text(rng, text)
        variants.append((f"variant {i} ({ndim}D; {name})", text))
    return variants


def check_transformation(path: Path) -> None:
    """Load ``path``; a transformation that loads must be valid: finite, within the bounds, and re-loadable."""
    loaded = Transformation.load(path)
    n = loaded.ndim
    assert loaded.matrix.shape == (n + 1, n + 1) and np.isfinite(loaded.matrix).all()
    for flow in loaded.cpab:
        assert isinstance(flow.steps, int) and 1 <= flow.steps <= MAX_STEPS
        assert bool((flow.theta.abs() <= MAX_THETA).all())  # also false for NaN
        assert isinstance(flow.basis.volume_preserving, bool)
        assert all(np.isfinite(v) and v > 0 for v in (flow.length_scale, flow.variance))
    again = Transformation.from_dict(json.loads(json.dumps(loaded.to_dict())))
    points = loaded.fixed_grid.world_points(torch.float64).reshape(-1, n)[:5]
    moved = loaded.transform_world(points)
    assert bool(torch.isfinite(moved).all())
    torch.testing.assert_close(again.transform_world(points), moved)


@pytest.mark.parametrize("half", [0, 1])
def test_fuzzed_transform_files_load_or_fail_in_one_line(tmp_path, half):
    variants = transform_variants(random.Random(29 + half), VARIANTS // 2)
    path = tmp_path / "transform.json"
    assert_none_broken(run_variants(variants, path, check_transformation, (str(path),)), len(variants))
