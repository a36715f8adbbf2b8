"""regkit.config.layers: presets, YAML with line numbers, bases, overrides and relative paths."""

from __future__ import annotations

import pytest

from regkit.config import (
    FeaturesSimilarity,
    dump_config,
    list_presets,
    load_config,
)
from regkit.config.layers import MAX_YAML_BYTES, MAX_YAML_DEPTH, MAX_YAML_NODES
from tests.regkit.config.yaml_files import config_error, write_yaml


def test_presets_are_listed():
    assert {"brain-mri-3d", "brain-mri-3d-multimodal", "ct-3d", "histology-2d", "quick-2d", "demo"} <= set(
        list_presets()
    )


def test_exponent_without_dot_is_a_float(tmp_path):
    path = write_yaml(
        tmp_path, "stages:\n  - type: affine\n    similarity: {name: mse}\n    optimizer: {tolerance: 1e-6}\n"
    )
    assert load_config(str(path)).stages[0].optimizer.tolerance == 1e-6


def test_missing_file(tmp_path):
    path = tmp_path / "absent.yaml"
    assert config_error(str(path)) == f"{path}: no such file"


def test_unknown_preset_lists_presets_and_suggests():
    error = config_error("brain-mri")
    assert "'brain-mri' is neither a YAML file nor a preset; did you mean 'brain-mri-3d'?" in error
    assert all(name in error for name in list_presets())


def test_multiple_documents_are_rejected(tmp_path):
    error = config_error(str(write_yaml(tmp_path, "dim: 3\n---\ndim: 2\n")))
    assert error.startswith(f"{tmp_path / 'cfg.yaml'}:2: invalid YAML")


def test_unsafe_tags_are_rejected(tmp_path):
    error = config_error(str(write_yaml(tmp_path, "seed: !!python/object/apply:os.getpid []\n")))
    assert error.startswith(f"{tmp_path / 'cfg.yaml'}:1: invalid YAML")


def test_overrides_merge_deeply():
    cfg = load_config("demo", {"device": "cpu", "seed": 7, "outputs": {"qc_png": False}})
    base = load_config("demo")
    assert (cfg.device, cfg.seed, cfg.outputs.qc_png) == ("cpu", 7, False)
    assert cfg.outputs.warped and cfg.stages == base.stages


def test_override_errors_name_the_overrides():
    assert config_error("demo", {"device": "tpu"}).startswith("overrides: device: must be")


def test_base_and_override(tmp_path):
    text = """\
# starts from the brain preset
base: brain-mri-3d
seed: 3
outputs:
  qc_png: false
"""
    cfg = load_config(str(write_yaml(tmp_path, text)))
    base = load_config("brain-mri-3d")
    assert cfg.seed == 3 and not cfg.outputs.qc_png and cfg.outputs.jacobian
    assert cfg.stages == base.stages


def test_lists_replace_and_mappings_merge_through_a_base_file(tmp_path):
    write_yaml(
        tmp_path,
        "device: cpu\nstages:\n  - type: moments\n  - type: affine\n    similarity: {name: mse}\n",
        "base.yaml",
    )
    sub = tmp_path / "sub"
    sub.mkdir()
    path = write_yaml(sub, "base: ../base.yaml\nstages:\n  - type: rigid\n    similarity: {name: ncc}\n")
    cfg = load_config(str(path))
    assert cfg.device == "cpu"
    assert [s.type for s in cfg.stages] == ["rigid"]


def test_error_in_a_base_file_points_into_it(tmp_path):
    base = write_yaml(tmp_path, "stages:\n  - type: moments\nseed: -2\n", "base.yaml")
    path = write_yaml(tmp_path, "base: base.yaml\ndim: 2\n")
    assert config_error(str(path)).startswith(f"{base}:3: seed: must be >= 0")


def test_error_in_an_overriding_stage_ignores_the_base_lines(tmp_path):
    path = write_yaml(tmp_path, "base: demo\nstages:\n  - type: rigid\n")
    assert config_error(str(path)).startswith(f"{path}:3: stages[0].similarity: required key missing")


def test_unknown_and_circular_bases(tmp_path):
    path = write_yaml(tmp_path, "dim: 3\nbase: demmo\n")
    assert config_error(str(path)).startswith(
        f"{path}:2: base: 'demmo' is neither a YAML file nor a preset; did you mean 'demo'?"
    )
    write_yaml(tmp_path, "base: b.yaml\n", "a.yaml")
    write_yaml(tmp_path, "base: ../" + tmp_path.name + "/a.yaml\n", "b.yaml")
    assert "circular base" in config_error(str(tmp_path / "a.yaml"))


def test_relative_paths_resolve_against_the_yaml_folder(tmp_path):
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets" / "w.pt").write_bytes(b"")
    write_yaml(
        tmp_path, "stages:\n  - type: affine\n    similarity: {name: features, weights: nets/w.pt}\n", "base.yaml"
    )
    sub = tmp_path / "sub"
    sub.mkdir()
    cfg = load_config(str(write_yaml(sub, "base: ../base.yaml\nseed: 1\n")))
    similarity = cfg.stages[0].similarity
    assert isinstance(similarity, FeaturesSimilarity)
    assert similarity.weights is not None and similarity.weights.samefile(tmp_path / "nets" / "w.pt")
    dumped = write_yaml(sub, dump_config(cfg), "dumped.yaml")
    assert load_config(str(dumped)) == cfg


def test_anchors_and_aliases(tmp_path):
    text = """\
stages:
  - type: affine
    similarity: {name: ncc}
    pyramid: &pyramid
      - {shrink: 2, smoothing: 1.0}
      - {shrink: 1, smoothing: 0.0}
  - type: cpab
    similarity: {name: ncc}
    pyramid: *pyramid
    tessellation: [4, 8]
"""
    cfg = load_config(str(write_yaml(tmp_path, text)))
    assert cfg.stages[0].pyramid == cfg.stages[1].pyramid


def test_merge_keys_load(tmp_path):
    text = """\
base: quick-2d
stages:
  - type: affine
    similarity: &sim {name: ncc}
    optimizer: &opt {learning_rate: 0.1, iterations: 5}
  - type: cpab
    similarity: *sim
    optimizer: {<<: *opt, iterations: 3}
    tessellation: [2, 4]
    pyramid: [{shrink: 2, smoothing: 1.0}, {shrink: 1, smoothing: 0.0}]
"""
    cfg = load_config(str(write_yaml(tmp_path, text)))
    affine, cpab = cfg.stages
    assert affine.similarity == cpab.similarity
    assert (cpab.optimizer.learning_rate, cpab.optimizer.iterations) == (0.1, 3)


def alias_bomb(levels: int) -> str:
    """Billion laughs: ``levels`` anchored lists, each of nine aliases of the one before (9**levels strings)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (alias_bomb(9), f":6: more than {MAX_YAML_NODES} YAML nodes, each alias counted as the nodes it repeats"),
        ("seed: 1\nx: &x [1, *x]\n", ":2: the alias *x is inside its own anchor"),
        ("x: &x {a: {b: *x}}\n", ":1: the alias *x is inside its own anchor"),
        ("x: &x {<<: *x}\n", ":1: the alias *x is inside its own anchor"),
        ("x: " + "[" * 10_000 + "]" * 10_000 + "\n", f":1: nested more than {MAX_YAML_DEPTH} levels deep"),
        ("x:" + "".join("\n" + "  " * (i + 1) + "-" for i in range(200)) + " 1\n", ":65: nested more than"),
        (
            "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 100)),
            f":63: nested more than {MAX_YAML_DEPTH} levels deep once aliases are expanded",
        ),
        (
            "a0: &a0 {k: 1}\n" + "".join(f"a{i}: &a{i} {{<<: *a{i - 1}}}\n" for i in range(1, 100)),
            "levels deep once aliases are expanded",
        ),
        ("seed: " + "1" * 5000 + "\n", ":1: seed: not a valid int (Exceeds the limit (4300 digits)"),
        ("stages:\n  - type: 2001-13-45\n", ":2: stages[0].type: not a valid timestamp (month must be in 1..12)"),
        ('device: "cpu\\0"\n', ":1: device: a NUL character (\\0) in 'cpu\\x00'"),
        ("outputs: {<<: {1: x}}\n", ":1: outputs: keys must be strings (got an integer 1)"),
    ],
)
def test_hostile_yaml_is_refused_in_one_line_at_its_line(tmp_path, text, message):
    """Alias bombs, recursive aliases (also through merge keys), deep nesting (also through chains of aliases), values
    their tag cannot hold, NUL characters and non-string keys: one line, the file and the line."""
    path = write_yaml(tmp_path, text)
    error = config_error(str(path))
    assert error.startswith(str(path)) and message in error


def test_files_over_the_size_limit_and_non_utf8_files_are_refused(tmp_path):
    big = write_yaml(tmp_path, "seed: 1\n" + "#" * MAX_YAML_BYTES + "\n", "big.yaml")
    assert config_error(str(big)) == f"{big}: larger than 4 MiB, the most regkit reads from a YAML file"
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("seed: 1\n# caf\u00e9\n".encode("latin-1"))
    assert config_error(str(latin1)) == f"{latin1}:2: not a UTF-8 text file"
