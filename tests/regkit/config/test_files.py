"""regkit.config.files: loading the presets, dump/load round trips, hashes."""

from __future__ import annotations

import pytest
import yaml

from regkit.config import (
    CpabStage,
    LnccSimilarity,
    config_hash,
    dump_config,
    list_presets,
    load_config,
)
from regkit.errors import ConfigError


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


def test_brain_preset_schedule():
    cfg = load_config("brain-mri-3d")
    assert [s.type for s in cfg.stages] == ["moments", "affine", "cpab"]
    cpab = cfg.stages[-1]
    assert isinstance(cpab, CpabStage)
    assert isinstance(cpab.similarity, LnccSimilarity)
    assert cpab.level_cells(3) == ((8, 8, 8), (16, 16, 16), (24, 24, 24))
    assert len(cpab.pyramid) == 3


def test_2d_presets_are_2d():
    assert load_config("histology-2d").dim == load_config("image-2d").dim == 2
    assert load_config("quick-2d").dim == 2


def test_hash_differs_between_configs():
    assert config_hash(load_config("demo")) != config_hash(load_config("demo", {"seed": 1}))
    assert len(config_hash(load_config("demo"))) == 64


def test_dump_is_yaml_with_every_default():
    data = yaml.safe_load(dump_config(load_config("quick-2d")))
    assert data["outputs"]["transform_h5"] is True
    assert data["stages"][-1]["prior"]["length_scale"] == 0.1
    assert data["stages"][-1]["tessellation"] == [4, 8]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"seed": 10**23}, "seed: must be <= 4294967295"),
        (
            {"stages": [{"type": "rigid", "similarity": {"name": "ncc"}, "optimizer": {"learning_rate": 1e30}}]},
            "stages[0].optimizer.learning_rate: must be <= 100",
        ),
        (
            {"stages": [{"type": "rigid", "similarity": {"name": "ncc"}, "optimizer": {"iterations": 10**12}}]},
            "stages[0].optimizer.iterations: must be <= 100000",
        ),
        (
            {
                "stages": [
                    {"type": "rigid", "similarity": {"name": "ncc"}, "pyramid": [{"shrink": 1, "smoothing": 1e7}]}
                ]
            },
            "stages[0].pyramid[0].smoothing: must be <= 64",
        ),
        (
            {"stages": [{"type": "cpab", "similarity": {"name": "lncc", "window": 999}}]},
            "stages[0].similarity.window: must be <= 63",
        ),
        (
            {"stages": [{"type": "cpab", "similarity": {"name": "ncc"}, "chain": 100000}]},
            "stages[0].chain: must be <= 16",
        ),
    ],
)
def test_numeric_settings_have_upper_bounds_named_in_the_error(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("quick-2d", overrides=override)
    assert message in str(err.value)
