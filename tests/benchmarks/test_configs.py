"""The accuracy benchmark's configurations (benchmarks/configs/): each is valid, says what it is for, and round-trips
through dump_config as the presets do."""

from pathlib import Path

import pytest

from regkit.config import config_hash, dump_config, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "configs").glob("*.yaml"))


def test_the_configurations_are_there():
    assert {path.stem for path in CONFIGS} >= {f"accuracy-{n}d-{kind}" for n in (2, 3) for kind in ("lncc", "mi")}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_configuration_is_valid_and_round_trips_through_dump(path, tmp_path):
    assert path.read_text().startswith("# ")
    cfg = load_config(path)
    assert cfg.dim == int(path.stem.split("-")[1][0])
    text = dump_config(cfg)
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(text)
    again = load_config(dumped)
    assert again == cfg
    assert dump_config(again) == text
    assert config_hash(again) == config_hash(cfg)
