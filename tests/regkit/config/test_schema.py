"""regkit.config.schema: the models, their documentation and registries, strictness, per-level schedules."""

from __future__ import annotations

import pydantic
import pytest

from regkit.config import (
    SIMILARITIES,
    STAGES,
    AffineStage,
    CpabStage,
    MomentsStage,
    NccSimilarity,
    RegistrationConfig,
    load_config,
)
from regkit.errors import ConfigError
from tests.regkit.config.yaml_files import config_error, write_yaml


def _all_models():
    seen = []
    todo = [RegistrationConfig, *STAGES.values(), *(measure.options for measure in SIMILARITIES.values())]
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
    path = write_yaml(
        tmp_path, "stages:\n  - type: affine\n    similarity: {name: mse}\n    optimizer: {learning_rate: 1}\n"
    )
    assert load_config(str(path)).stages[0].optimizer.learning_rate == 1.0


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
    stage = load_config(str(write_yaml(tmp_path, text))).stages[0]
    assert isinstance(stage, CpabStage)
    assert stage.level_iterations() == (20, 10)
    assert stage.level_cells(3) == ((4, 4, 4), (12, 14, 10))
    with pytest.raises(ConfigError, match="2D"):
        stage.level_cells(2)


def test_missing_weights_file(tmp_path):
    path = write_yaml(
        tmp_path, "stages:\n  - type: affine\n    similarity:\n      name: features\n      weights: w.pt\n"
    )
    assert config_error(str(path)).startswith(
        f"{path}:5: stages[0].similarity.weights: no such file: {tmp_path / 'w.pt'}"
    )
