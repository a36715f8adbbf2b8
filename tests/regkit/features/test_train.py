"""Feature training on tiny inputs: the synthesis keeps its correspondence, a few steps reduce the loss, a resumed run
continues exactly, the recipe is strict, and the shipped recipes load."""

import math
from pathlib import Path

import pytest
import torch

from regkit.errors import ConfigError, RegkitError
from regkit.features import training
from regkit.features.network import FeatureMaps
from regkit.features.training.recipe import (
    FeatureTrainingConfig,
    LossConfig,
    load_training_config,
    training_presets,
)
from regkit.features.training.synth import LabelVolume, ViewPair, crop_flow, synthesise_pair
from regkit.features.training.train import (
    Trainer,
    check_output,
    excluded_keys,
    info_nce,
    local_contrast,
    local_offsets,
    pair_loss,
    train_features,
)
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image


def _volume() -> LabelVolume:
    """A 24^3 toy head at 2 mm: nested ellipsoids (white matter inside grey matter, four grey-matter parcels by
    quadrant, a ventricle), labels 0..7."""
    z, y, x = torch.meshgrid(*(torch.linspace(-1, 1, 24),) * 3, indexing="ij")
    r = (x / 0.8) ** 2 + (y / 0.9) ** 2 + (z / 0.7) ** 2
    labels = torch.zeros(24, 24, 24, dtype=torch.long)
    labels[r < 1] = 1 + (x[r < 1] > 0).long() + 2 * (y[r < 1] > 0).long()  # grey-matter parcels 1..4
    labels[r < 0.5] = 5  # white matter
    labels[(x.abs() < 0.15) & (y.abs() < 0.3) & (z.abs() < 0.2)] = 6  # ventricle
    labels[(x - 0.3) ** 2 + (y + 0.3) ** 2 + z**2 < 0.02] = 7  # a deep nucleus
    distance = ((r.sqrt() - 1).clamp_min(0) * 16).float()  # ~mm outside the head
    return LabelVolume(labels, distance, 2.0, torch.tensor([0, 1, 1, 1, 1, 2, 3, 1]))


def _config(dim: int, **changes) -> FeatureTrainingConfig:
    data = {
        "dim": dim,
        "device": "cpu",
        "steps": 3,
        "batch_size": 2,
        "warmup": 1,
        "learning_rate": 5e-3,
        "checkpoint_every": 2,
        "network": {"channels": [4, 8], "depths": [1, 1], "levels": [2, 1], "kernel_size": 3, "features": 8},
        "synthesis": {"crop": 16 if dim == 2 else 12, "voxel_size": [1.5, 2.5], "cells": 2},
        "loss": {"points": 48, "temperature": 0.1},
        **changes,
    }
    return FeatureTrainingConfig.model_validate(data)


_CLEAN = {"texture": 0.0, "blur": 0.0, "resolution_probability": 0.0, "bias": 0.0, "gamma": 0.0, "noise": 0.0}


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.parametrize("dim", [2, 3])
def test_views_correspond(dim):
    """With one contrast and no degradation, view A interpolated at the correspondence reproduces view B best (the
    labels are sampled by nearest neighbour, so not exactly)."""
    synthesis = {"crop": 24, "voxel_size": [1.0, 1.5], "cells": 2, "same_contrast": 1.0, **_CLEAN}
    cfg = _config(dim, synthesis=synthesis)
    volume, flow = _volume(), crop_flow(dim, 24, 2, 2)
    pair = synthesise_pair(volume, cfg.synthesis, flow, torch.Generator().manual_seed(3), torch.Generator())
    assert pair.a.shape == pair.b.shape == (2, 1, *(24,) * dim)
    assert pair.corr.shape == (2, *(24,) * dim, dim)
    grid = Grid.create((24,) * dim)
    for k in range(2):
        valid, b = pair.valid[k], pair.b[k, 0]
        assert valid.float().mean() > 0.2

        def match(shift: torch.Tensor, k: int = k, valid: torch.Tensor = valid, b: torch.Tensor = b) -> float:
            return _correlation(sample_image(pair.a[k, 0], grid, pair.corr[k] + shift)[valid], b[valid])

        best = match(torch.zeros(dim))
        assert best > 0.8
        for step in torch.eye(dim):
            assert best > max(match(step), match(-step))
    again = synthesise_pair(volume, cfg.synthesis, flow, torch.Generator().manual_seed(3), torch.Generator())
    torch.testing.assert_close(again.b, pair.b)


def test_matches_lie_away_from_the_same_position():
    """A voxel's match in the other view is rarely at its own crop position, so encoding the position (which the crop
    borders reveal) cannot solve the task: the mean offset is a good fraction of the crop."""
    cfg = _config(2, synthesis={"crop": 32, "cells": 2})
    flow = crop_flow(2, 32, 2, 2)
    pair = synthesise_pair(_volume(), cfg.synthesis, flow, torch.Generator().manual_seed(5), torch.Generator())
    position = Grid.create((32, 32)).index_points()
    offset = (pair.corr - position).norm(dim=-1)[pair.valid]
    assert offset.mean() > 32 / 8


def test_info_nce_prefers_matching_keys_and_ignores_near_ones():
    torch.manual_seed(0)
    query = torch.nn.functional.normalize(torch.randn(16, 8), dim=1)
    positions = torch.arange(16.0)[:, None] * 5
    one = torch.zeros(16, dtype=torch.long)
    none = excluded_keys(one, positions, one, positions, 2.0)
    assert not none.any()
    matched = info_nce(query, query, none, 0.1)
    assert matched < math.log(16) < info_nce(query, query.roll(1, 0), none, 0.1)
    decoys = torch.cat((query, query))  # a copy of every key, as an extra negative
    far = excluded_keys(one, positions, torch.cat((one, one)), torch.cat((positions, positions + 100)), 2.0)
    near = excluded_keys(one, positions, torch.cat((one, one)), torch.cat((positions, positions + 1)), 2.0)
    assert near[:, 16:].equal(torch.eye(16, dtype=torch.bool)) and not far.any()
    other = excluded_keys(one, positions, torch.cat((one, one + 1)), torch.cat((positions, positions + 1)), 2.0)
    assert not other.any()  # keys of another sample are always negatives
    assert matched < info_nce(query, decoys, near, 0.1) < info_nce(query, decoys, far, 0.1) - 0.5


def test_local_offsets_and_contrast():
    offsets = local_offsets(2, (2.0, 3.0, 5.0, 8.0))  # 8 directions, the diagonals rounded: (1, 1), (2, 2), ...
    assert offsets.shape == (32, 2) and offsets.abs().sum(dim=1).min() > 0
    assert len({tuple(o) for o in offsets.tolist()}) == 32
    assert [2.0, 0.0] in offsets.tolist() and [1.0, 1.0] in offsets.tolist() and [-6.0, 6.0] in offsets.tolist()
    assert local_offsets(3, (1.0,)).shape == (26, 3)
    step = torch.zeros(1, 1, 12, 12)
    step[..., 6:] = 1.0
    contrast = local_contrast(step)
    assert contrast.shape == (1, 12, 12)
    assert float(contrast[0, :, 0].max()) == 0.0 and float(contrast[0, :, 5].min()) > 0.4  # flat far away, edge near


def test_local_loss_finds_the_match_and_takes_views_without_edges():
    """Identical views, identity correspondence, random features: each anchor's positive is its own feature, so the
    loss is far below chance; the second sample's view B is uniform (no edges) and still gives anchors."""
    torch.manual_seed(0)
    size = 16
    a = torch.rand(2, 1, size, size)
    b = a.clone()
    b[1] = 0.5
    corr = Grid.create((size, size)).index_points()[None].repeat(2, 1, 1, 1)
    pair = ViewPair(a, b, corr, torch.ones(2, size, size, dtype=torch.bool))
    unit = torch.nn.functional.normalize
    maps = FeatureMaps(unit(torch.randn(2, 8, size, size), dim=1), unit(torch.randn(2, 8, size // 2, size // 2), dim=1))
    cfg = LossConfig(negatives="local", points=32, radii=(2.0, 3.0), temperature=0.1)
    full, half = pair_loss(maps, maps, pair, cfg, torch.Generator().manual_seed(0))
    assert float(full) < 0.5 * math.log(1 + 16) and torch.isfinite(half)


@pytest.mark.parametrize(("dim", "negatives"), [(2, "global"), (3, "global"), (2, "local"), (3, "local")])
def test_a_few_steps_reduce_the_loss(dim, negatives):
    loss_config = {"points": 48, "temperature": 0.1, "negatives": negatives, "radii": [2.0, 3.0]}
    trainer = Trainer(_config(dim, loss=loss_config), _volume())
    pair, _ = trainer.batch(0)

    def loss() -> torch.Tensor:
        full, half = trainer.loss(pair, torch.Generator().manual_seed(0))
        return full + half

    with torch.no_grad():
        before = float(loss())
    for _ in range(12):
        trainer.optimizer.zero_grad()
        loss().backward()
        trainer.optimizer.step()
    with torch.no_grad():
        after = float(loss())
    assert after < before - 0.2


def test_resume_continues_exactly(tmp_path):
    cfg, volume = _config(2), _volume()
    straight = train_features(cfg, tmp_path / "straight", volume=volume)
    assert straight.steps_done == 3
    first = train_features(cfg, tmp_path / "split", volume=volume, stop_after=2)
    assert first.steps_done == 2
    assert torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)["step"] == 2
    with pytest.raises(RegkitError, match="already holds a training run"):
        train_features(cfg, tmp_path / "split", volume=volume)
    resumed = train_features(cfg, tmp_path / "split", volume=volume, resume=True)
    assert resumed.steps_done == 3
    a = torch.load(straight.weights, weights_only=True)["state_dict"]
    b = torch.load(resumed.weights, weights_only=True)["state_dict"]
    assert all(torch.equal(a[key], b[key]) for key in a)
    log = (tmp_path / "split" / "log.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in log] == ["step", "1", "2", "3"]
    with pytest.raises(RegkitError, match="another configuration"):
        train_features(_config(2, seed=1), tmp_path / "split", volume=volume, resume=True)


def test_config_errors_name_file_and_line(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("dim: 2\nsteps: 10\nnetwork:\n  chanels: [8, 16]\n")
    with pytest.raises(ConfigError, match=r"train.yaml:4: network.chanels: unknown key 'chanels'; did you mean"):
        load_training_config(path)
    path.write_text("dim: 2\nsteps: 10\nsynthesis:\n  voxel_size: [3.0, 1.0]\n")
    with pytest.raises(ConfigError, match=r":4: synthesis.voxel_size: needs \(low, high\)"):
        load_training_config(path)
    path.write_text("dim: 2\nsteps: 10\ndevice: tpu\n")
    with pytest.raises(ConfigError, match=r"train.yaml:3: device: must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        load_training_config(path)
    with pytest.raises(ConfigError, match=r"no such file \(shipped training recipes: features-2d, features-3d\)"):
        load_training_config(tmp_path / "absent.yaml")


def test_shipped_recipes_load():
    """The recipes in regkit/features/training/ load by name, and each says what it is for."""
    assert training_presets() == ["features-2d", "features-3d"]
    folder = Path(training.__file__).parent
    for dim in (2, 3):
        cfg = load_training_config(f"features-{dim}d")
        assert cfg.dim == dim
        assert cfg == load_training_config(folder / f"features-{dim}d.yaml")
        assert (folder / f"features-{dim}d.yaml").read_text().startswith("# Self-supervised training")


def test_a_new_run_never_replaces_files_a_run_writes(tmp_path):
    (tmp_path / "features-2d.pt").write_text("precious")
    with pytest.raises(RegkitError, match=r"holds features-2d\.pt, which a training run would replace"):
        check_output(tmp_path, resume=False, dim=2)
    assert check_output(tmp_path, resume=False, dim=3) == tmp_path / "checkpoint.pt"
    assert (tmp_path / "features-2d.pt").read_text() == "precious"
