"""regkit.config: the schema, presets, YAML loading with line numbers, bases, overrides, dump/load round trips."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import yaml

from regkit.config import (
    SIMILARITIES,
    STAGES,
    AffineStage,
    CpabStage,
    FeaturesSimilarity,
    LnccSimilarity,
    MomentsStage,
    NccSimilarity,
    RegistrationConfig,
    config_hash,
    dump_config,
    list_presets,
    load_config,
)
from regkit.errors import ConfigError

# ---------------------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------------------


def test_presets_are_listed():
    assert {"brain-mri-3d", "brain-mri-3d-multimodal", "ct-3d", "histology-2d", "quick-2d", "demo"} <= set(
        list_presets()
    )


@pytest.mark.parametrize("name", list_presets())
def test_preset_round_trips_through_dump(name, tmp_path):
    cfg = load_config(name)
    text = dump_config(cfg)
    path = tmp_path / "dumped.yaml"
    path.write_text(text)
    again = load_config(str(path))
    assert again == cfg
    assert dump_config(again) == text
    assert config_hash(again) == config_hash(cfg)


@pytest.mark.parametrize("name", list_presets())
def test_preset_starts_with_a_comment(name):
    text = (Path(__import__("regkit").__file__).parent / "configs" / f"{name}.yaml").read_text()
    assert text.startswith("# ")


def test_brain_preset_schedule():
    cfg = load_config("brain-mri-3d")
    assert [s.type for s in cfg.stages] == ["moments", "affine", "cpab"]
    cpab = cfg.stages[-1]
    assert isinstance(cpab, CpabStage)
    assert isinstance(cpab.similarity, LnccSimilarity)
    assert cpab.level_cells(3) == ((4, 4, 4), (8, 8, 8), (12, 12, 12))
    assert len(cpab.pyramid) == 3


def test_2d_presets_are_2d():
    assert load_config("histology-2d").dim == 2
    assert load_config("quick-2d").dim == 2


def test_hash_differs_between_configs():
    assert config_hash(load_config("demo")) != config_hash(load_config("demo", {"seed": 1}))
    assert len(config_hash(load_config("demo"))) == 64


# ---------------------------------------------------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------------------------------------------------


def _all_models():
    seen = []
    todo = [RegistrationConfig, *STAGES.values(), *SIMILARITIES.values()]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.append(model)
        for field in model.model_fields.values():
            todo += [t for t in _walk(field.annotation) if isinstance(t, type) and issubclass(t, pydantic.BaseModel)]
    return seen


def _walk(annotation):
    yield annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        yield from _walk(arg)
    for arg in getattr(annotation, "__metadata__", ()) or ():
        yield from _walk(arg)


def test_every_model_and_field_is_documented():
    models = _all_models()
    assert len(models) >= 14
    for model in models:
        assert model.__doc__, model
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}"


def test_registries():
    assert list(SIMILARITIES) == ["mse", "ncc", "lncc", "mi", "features"]
    assert list(STAGES) == ["moments", "rigid", "affine", "cpab"]


def test_python_construction_accepts_lists_and_is_frozen():
    stage = AffineStage(
        similarity=NccSimilarity(), pyramid=[{"shrink": 2, "smoothing": 1}, {"shrink": 1, "smoothing": 0}]
    )
    cfg = RegistrationConfig(stages=[MomentsStage(), stage])
    assert cfg.stages[1].pyramid[0].smoothing == 2 / 2
    assert stage.level_iterations() == (100, 100)
    assert hash(cfg) == hash(RegistrationConfig(stages=(MomentsStage(), stage)))
    with pytest.raises(pydantic.ValidationError):
        cfg.seed = 3  # type: ignore[misc]


def test_no_silent_string_to_number_coercion():
    with pytest.raises(pydantic.ValidationError):
        CpabStage(similarity=NccSimilarity(), steps="50")  # type: ignore[arg-type]


def test_int_accepted_where_float_expected(tmp_path):
    path = _write(
        tmp_path, "stages:\n  - type: affine\n    similarity: {name: mse}\n    optimizer: {learning_rate: 1}\n"
    )
    assert load_config(str(path)).stages[0].optimizer.learning_rate == 1.0


def test_exponent_without_dot_is_a_float(tmp_path):
    path = _write(
        tmp_path, "stages:\n  - type: affine\n    similarity: {name: mse}\n    optimizer: {tolerance: 1e-6}\n"
    )
    assert load_config(str(path)).stages[0].optimizer.tolerance == 1e-6


def test_per_level_iterations_and_per_axis_cells(tmp_path):
    text = """\
dim: 3
stages:
  - type: cpab
    similarity: {name: ncc}
    pyramid: [{shrink: 2, smoothing: 1}, {shrink: 1, smoothing: 0}]
    optimizer: {iterations: [20, 10]}
    tessellation: [4, [12, 14, 10]]
"""
    stage = load_config(str(_write(tmp_path, text))).stages[0]
    assert isinstance(stage, CpabStage)
    assert stage.level_iterations() == (20, 10)
    assert stage.level_cells(3) == ((4, 4, 4), (12, 14, 10))
    with pytest.raises(ConfigError, match="2D"):
        stage.level_cells(2)


# ---------------------------------------------------------------------------------------------------------------------
# Errors: one line, FILE:LINE: key.path: message
# ---------------------------------------------------------------------------------------------------------------------


def _write(folder: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def _error(source: str | Path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


AFFINE = "  - type: affine\n    similarity: {name: ncc}\n"

ERRORS = {
    "tab": ("dim: 3\nstages:\n\t- type: affine\n", 3, "", "spaces, not tabs"),
    "unknown key": (
        f"stages:\n{AFFINE}    optimizer:\n      iteratons: 5\n",
        5,
        "stages[0].optimizer.iteratons",
        "unknown key 'iteratons'; did you mean 'iterations'?",
    ),
    "wrong type": (
        "stages:\n  - type: cpab\n    similarity: {name: ncc}\n    steps: '50'\n",
        4,
        "stages[0].steps",
        "expected an integer, got a string '50'",
    ),
    "out of range": (
        f"dim: 3\nstages:\n  - type: moments\n{AFFINE}    optimizer:\n      learning_rate: -1\n",
        7,
        "stages[1].optimizer.learning_rate",
        "must be > 0 (got -1)",
    ),
    "schedule length": (
        "stages:\n  - type: cpab\n    similarity: {name: ncc}\n    tessellation: [4, 8]\n",
        4,
        "stages[0].tessellation",
        "2 levels but the pyramid has 3",
    ),
    "schedule decreasing": (
        "stages:\n  - type: cpab\n    similarity: {name: ncc}\n    tessellation:\n"
        "      - 4\n      - 8\n      - [8, 4, 8]\n",
        7,
        "stages[0].tessellation[2]",
        "must not decrease",
    ),
    "cell count": (
        "stages:\n  - type: cpab\n    similarity: {name: ncc}\n    tessellation: [0, 8, 8]\n",
        4,
        "stages[0].tessellation[0]",
        "must be >= 1 (got 0)",
    ),
    "similarity name": (
        "stages:\n  - type: cpab\n    similarity:\n      name: lnc\n      window: 5\n",
        4,
        "stages[0].similarity.name",
        "unknown name 'lnc'; did you mean 'lncc'?",
    ),
    "stage type": ("stages:\n  - type: afine\n", 2, "stages[0].type", "did you mean 'affine'?"),
    "duplicate key": ("dim: 3\nseed: 1\ndim: 2\nstages: []\n", 3, "dim", "duplicate key (first set on line 1)"),
    "empty": ("# only a comment\n", 1, "", "empty"),
    "top-level list": ("- type: affine\n", 1, "", "expected a mapping"),
    "missing key": ("dim: 3\nstages:\n  - type: rigid\n", 3, "stages[0].similarity", "required key missing"),
    "even window": (
        "stages:\n  - type: cpab\n    similarity: {name: lncc, window: 8}\n",
        3,
        "stages[0].similarity.window",
        "must be odd",
    ),
    "even features lncc window": (
        "stages:\n  - type: cpab\n    similarity: {name: features, lncc_weight: 1.0, lncc_window: 4}\n",
        3,
        "stages[0].similarity.lncc_window",
        "must be odd (got 4)",
    ),
    "negative features lncc weight": (
        "stages:\n  - type: cpab\n    similarity: {name: features, lncc_weight: -1.0}\n",
        3,
        "stages[0].similarity.lncc_weight",
        "must be >= 0",
    ),
    "features distance": (
        "stages:\n  - type: cpab\n    similarity: {name: features, distance: l2}\n",
        3,
        "stages[0].similarity.distance",
        "'cosine'",
    ),
    "literal": (
        f"stages:\n{AFFINE}    optimizer: {{name: adamw}}\n",
        4,
        "stages[0].optimizer.name",
        "must be 'adam' or 'lbfgs' (got a string 'adamw'); did you mean 'adam'?",
    ),
    "iterations count": (
        f"stages:\n{AFFINE}    optimizer:\n      iterations: [10, 5]\n",
        5,
        "stages[0].optimizer.iterations",
        "2 entries for 3 pyramid levels",
    ),
    "pyramid order": (
        f"stages:\n{AFFINE}    pyramid:\n      - {{shrink: 1, smoothing: 0}}\n      - {{shrink: 2, smoothing: 0}}\n",
        6,
        "stages[0].pyramid[1].shrink",
        "must not increase",
    ),
    "device": ("device: gpu\nstages:\n  - type: moments\n", 1, "device", "'cuda:N' (got 'gpu')"),
    "dim vs cells": (
        "dim: 2\nstages:\n  - type: cpab\n    similarity: {name: ncc}\n    tessellation: [4, 8, [12, 14, 10]]\n",
        5,
        "stages[0].tessellation[2]",
        "3 per-axis cell counts but dim is 2",
    ),
    "moments not first": (
        f"stages:\n{AFFINE}  - type: moments\n",
        4,
        "stages[1].type",
        "can only be the first stage",
    ),
    "no stages": ("dim: 3\nstages: []\n", 2, "stages", "at least one stage"),
    "bool as int": ("seed: true\nstages:\n  - type: moments\n", 1, "seed", "expected an integer, got a boolean"),
    "syntax": ("dim: 3\nstages: [1, 2\nseed: 3\n", 3, "", "invalid YAML"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_error_names_file_line_and_key(case, tmp_path):
    text, line, key, message = ERRORS[case]
    path = _write(tmp_path, text)
    error = _error(str(path))
    prefix = f"{path}:{line}: " + (f"{key}: " if key else "")
    assert error.startswith(prefix), error
    assert message in error, error


def test_several_errors_report_the_first_by_line(tmp_path):
    path = _write(tmp_path, "dtype: float16\nseed: -1\nstages:\n  - type: moments\n")
    error = _error(str(path))
    assert error.startswith(f"{path}:1: dtype: must be 'float32' or 'float64'")
    assert error.endswith("(and 1 more)")


def test_unknown_top_level_key(tmp_path):
    error = _error(str(_write(tmp_path, "stages:\n  - type: moments\nbackand: torch\n")))
    assert error.endswith(":3: backand: unknown key 'backand'; did you mean 'backend'?")


def test_missing_file(tmp_path):
    path = tmp_path / "absent.yaml"
    assert _error(str(path)) == f"{path}: no such file"


def test_unknown_preset_lists_presets_and_suggests():
    error = _error("brain-mri")
    assert "'brain-mri' is neither a YAML file nor a preset; did you mean 'brain-mri-3d'?" in error
    assert all(name in error for name in list_presets())


def test_multiple_documents_are_rejected(tmp_path):
    error = _error(str(_write(tmp_path, "dim: 3\n---\ndim: 2\n")))
    assert error.startswith(f"{tmp_path / 'cfg.yaml'}:2: invalid YAML")


def test_unsafe_tags_are_rejected(tmp_path):
    error = _error(str(_write(tmp_path, "seed: !!python/object/apply:os.getpid []\n")))
    assert error.startswith(f"{tmp_path / 'cfg.yaml'}:1: invalid YAML")


# ---------------------------------------------------------------------------------------------------------------------
# Overrides, bases, paths
# ---------------------------------------------------------------------------------------------------------------------


def test_overrides_merge_deeply():
    cfg = load_config("demo", {"device": "cpu", "seed": 7, "outputs": {"qc_png": False}})
    base = load_config("demo")
    assert (cfg.device, cfg.seed, cfg.outputs.qc_png) == ("cpu", 7, False)
    assert cfg.outputs.warped and cfg.stages == base.stages


def test_override_errors_name_the_overrides():
    assert _error("demo", {"device": "tpu"}).startswith("overrides: device: must be")


def test_base_and_override(tmp_path):
    text = """\
# starts from the brain preset
base: brain-mri-3d
seed: 3
outputs:
  qc_png: false
"""
    cfg = load_config(str(_write(tmp_path, text)))
    base = load_config("brain-mri-3d")
    assert cfg.seed == 3 and not cfg.outputs.qc_png and cfg.outputs.jacobian
    assert cfg.stages == base.stages


def test_lists_replace_and_mappings_merge_through_a_base_file(tmp_path):
    _write(
        tmp_path,
        "device: cpu\nstages:\n  - type: moments\n  - type: affine\n    similarity: {name: mse}\n",
        "base.yaml",
    )
    sub = tmp_path / "sub"
    sub.mkdir()
    path = _write(sub, "base: ../base.yaml\nstages:\n  - type: rigid\n    similarity: {name: ncc}\n")
    cfg = load_config(str(path))
    assert cfg.device == "cpu"
    assert [s.type for s in cfg.stages] == ["rigid"]


def test_error_in_a_base_file_points_into_it(tmp_path):
    base = _write(tmp_path, "stages:\n  - type: moments\nseed: -2\n", "base.yaml")
    path = _write(tmp_path, "base: base.yaml\ndim: 2\n")
    assert _error(str(path)).startswith(f"{base}:3: seed: must be >= 0")


def test_error_in_an_overriding_stage_ignores_the_base_lines(tmp_path):
    path = _write(tmp_path, "base: demo\nstages:\n  - type: rigid\n")
    assert _error(str(path)).startswith(f"{path}:3: stages[0].similarity: required key missing")


def test_unknown_and_circular_bases(tmp_path):
    path = _write(tmp_path, "dim: 3\nbase: demmo\n")
    assert _error(str(path)).startswith(
        f"{path}:2: base: 'demmo' is neither a YAML file nor a preset; did you mean 'demo'?"
    )
    _write(tmp_path, "base: b.yaml\n", "a.yaml")
    _write(tmp_path, "base: ../" + tmp_path.name + "/a.yaml\n", "b.yaml")
    assert "circular base" in _error(str(tmp_path / "a.yaml"))


def test_relative_paths_resolve_against_the_yaml_folder(tmp_path):
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets" / "w.pt").write_bytes(b"")
    _write(tmp_path, "stages:\n  - type: affine\n    similarity: {name: features, weights: nets/w.pt}\n", "base.yaml")
    sub = tmp_path / "sub"
    sub.mkdir()
    cfg = load_config(str(_write(sub, "base: ../base.yaml\nseed: 1\n")))
    similarity = cfg.stages[0].similarity
    assert isinstance(similarity, FeaturesSimilarity)
    assert similarity.weights is not None and similarity.weights.samefile(tmp_path / "nets" / "w.pt")
    dumped = _write(sub, dump_config(cfg), "dumped.yaml")
    assert load_config(str(dumped)) == cfg


def test_missing_weights_file(tmp_path):
    path = _write(tmp_path, "stages:\n  - type: affine\n    similarity:\n      name: features\n      weights: w.pt\n")
    assert _error(str(path)).startswith(f"{path}:5: stages[0].similarity.weights: no such file: {tmp_path / 'w.pt'}")


def test_dump_is_yaml_with_every_default():
    data = yaml.safe_load(dump_config(load_config("quick-2d")))
    assert data["outputs"]["transform_h5"] is True
    assert data["stages"][-1]["prior"]["length_scale"] == 0.1
    assert data["stages"][-1]["tessellation"] == [4, 8]


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
    cfg = load_config(str(_write(tmp_path, text)))
    assert cfg.stages[0].pyramid == cfg.stages[1].pyramid
