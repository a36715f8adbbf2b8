"""``python -m benchmarks accuracy``: its metrics against hand-computed values, its pair generator, a tiny regkit run.

tests/regkit/spatial/test_metrics.py covers the metric functions themselves (Dice of hand-made maps, the determinant of
linear fields, Learn2Reg's Jacobian and SDlogJ, HD95 of shifted cubes); here they are checked through ``evaluate``, the
way the benchmark applies them to a tool's displacement field.
"""

from __future__ import annotations

import csv
import math
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from benchmarks.__main__ import app
from benchmarks.accuracy import evaluate, run_process
from benchmarks.accuracy_pairs import BenchPair, make_pairs, read_displacement, t2_like, tissue_classes
from regkit.errors import RegkitError
from regkit.io import Image, write_displacement
from regkit.spatial.grid import Grid
from regkit.spatial.metrics import mean_dice
from regkit.spatial.sampling import sample_image
from tests.helpers import ITK_DATA


def _pair(fixed_labels: torch.Tensor, moving_labels: torch.Tensor, grid: Grid, truth: torch.Tensor | None) -> BenchPair:
    image = Image(torch.zeros(grid.shape), grid)
    return BenchPair(
        "p", "test", "mono", "", image, image, Image(fixed_labels, grid), Image(moving_labels, grid), truth
    )


def test_dice_hd95_and_epe_of_a_shifted_square():
    """A 4 x 4 square moved by 2 voxels along x (spacing 1.5 mm): identity overlaps half of it (Dice 2*8/32 = 0.5,
    HD95 = the 3 mm shift, EPE 3 mm); the true shift gives Dice 1, HD95 0, EPE 0."""
    grid = Grid.create((12, 10), (1.5, 1.0))
    fixed = torch.zeros(grid.shape, dtype=torch.int32)
    fixed[3:7, 2:6] = 4
    moving = torch.roll(fixed, 2, dims=1)  # moving(x + 3 mm) = fixed(x): the pull-back is u = (3, 0) mm
    shift = torch.zeros(*grid.shape, 2, dtype=torch.float64)
    shift[..., 0] = 3.0
    pair = _pair(fixed, moving, grid, shift.float())
    before = evaluate(pair, torch.zeros_like(shift))
    assert before["dice"] == pytest.approx(0.5)
    assert before["hd95_mm"] == pytest.approx(3.0)
    assert before["epe_mm"] == pytest.approx(3.0)
    after = evaluate(pair, shift)
    assert (after["dice"], after["hd95_mm"], after["epe_mm"], after["folds"], after["sdlogj"]) == (1.0, 0.0, 0, 0, 0)


def test_folds_of_a_reflection_and_of_a_rotation():
    """u(x) = (A - I) x: a rotation-and-scaling never folds (SDlogJ 0: the determinant is constant); a reflection
    (det A = -1) folds every voxel."""
    grid = Grid.create((9, 8, 7), (1.0, 1.2, 0.8), (3.0, -2.0, 5.0))
    x = grid.world_points(torch.float64)
    labels = torch.ones(grid.shape, dtype=torch.int32)
    pair = _pair(labels, labels, grid, None)
    c, s = math.cos(0.3), math.sin(0.3)
    for matrix, folds in (([[1.1 * c, -s, 0], [s, c, 0], [0, 0, 0.9]], 0.0), ([[-1, 0, 0], [0, 1, 0], [0, 0, 1]], 1.0)):
        u = x @ (torch.tensor(matrix, dtype=torch.float64) - torch.eye(3)).T
        result = evaluate(pair, u)
        assert result["folds"] == folds
        assert result["sdlogj"] == pytest.approx(0.0, abs=1e-12)
        assert "epe_mm" not in result


def test_folds_of_a_sine_field_hand_counted():
    """u_x = a sin(2 pi x / 16) with a sin(2 pi / 16) = 2: central differences give det = 1 + 2 cos(2 pi x / 16),
    non-positive where x mod 16 is 6..10. On 32 columns cropped by 2 (columns 2..29) that is 10 of 28 columns."""
    grid = Grid.create((32, 12))
    x = grid.world_points(torch.float64)[..., 0]
    amplitude = 2.0 / math.sin(2 * math.pi / 16)
    u = torch.stack([amplitude * torch.sin(2 * math.pi * x / 16), torch.zeros_like(x)], dim=-1)
    labels = torch.ones(grid.shape, dtype=torch.int32)
    assert evaluate(_pair(labels, labels, grid, None), u)["folds"] == pytest.approx(10 / 28)


def test_read_displacement_checks_the_grid(tmp_path: Path):
    grid = Grid.create((6, 5, 4), (1.0, 2.0, 3.0), (1.0, 2.0, 3.0), [[-1, 0, 0], [0, -1, 0], [0, 0, 1]])
    field = torch.randn(*grid.shape, 3)
    write_displacement(field, grid, tmp_path / "u.mha")
    torch.testing.assert_close(read_displacement(tmp_path / "u.mha", grid), field.double())
    other = Grid.create((6, 5, 4), (1.0, 2.0, 3.0), (1.0, 2.0, 3.0))
    with pytest.raises(RegkitError, match="not a 3-vector image on the fixed grid"):
        read_displacement(tmp_path / "u.mha", other)


def test_pairs_are_deterministic_and_their_truth_fits():
    first, again, other = (make_pairs("mni2d", 2, seed) for seed in (3, 3, 4))
    assert [p.name for p in first] == ["mni2d-0", "mni2d-1"]
    for a, b, c in zip(first, again, other, strict=True):
        assert torch.equal(a.fixed.data, b.fixed.data) and torch.equal(a.true_displacement, b.true_displacement)
        assert not torch.equal(a.fixed.data, c.fixed.data)
    assert not torch.equal(first[0].fixed.data, first[1].fixed.data)
    for pair in first:  # the moving labels at x + u_true are the fixed labels (both nearest samples of the atlas)
        points = pair.fixed.grid.world_points(torch.float64) + pair.true_displacement.double()
        warped = sample_image(pair.moving_labels.data, pair.moving_labels.grid, points, mode="nearest")
        assert mean_dice(pair.fixed_labels.data, warped) == 1.0
        assert evaluate(pair, pair.true_displacement)["epe_mm"] == 0.0


def _correlation_at(pair: BenchPair, displacement: torch.Tensor) -> float:
    points = pair.fixed.grid.world_points(torch.float64) + displacement.double()
    warped = sample_image(pair.moving.data.double(), pair.moving.grid, points)
    inside = pair.fixed_labels.data != 0
    return float(torch.corrcoef(torch.stack([warped[inside], pair.fixed.data.double()[inside]]))[0, 1])


def test_known_transforms_of_the_nibabel_and_itk_pairs():
    """The recorded truths align the images far better than the identity (a wrong sign or RAS/LPS mix-up does not)."""
    pairs = make_pairs("nibabel")
    if (ITK_DATA / "BrainProtonDensitySliceR10X13Y17.png").exists():
        pairs += [p for p in make_pairs("itk2d") if p.name == "itk2d-rigid"]
    for pair in pairs:
        zero = torch.zeros_like(pair.true_displacement)
        assert _correlation_at(pair, pair.true_displacement) > _correlation_at(pair, zero) + 0.3, pair.name


def test_sanity_shift_is_stored_in_another_orientation():
    identity, shifted, shifted_2d = make_pairs("sanity")
    assert torch.equal(identity.fixed.data, identity.moving.data)
    for pair in (shifted, shifted_2d):
        assert np.diag(pair.moving.grid.direction)[:2].tolist() == (-np.diag(pair.fixed.grid.direction)[:2]).tolist()
        assert evaluate(pair, pair.true_displacement)["dice"] == 1.0


def test_t2_like_reverses_the_tissue_order_and_tissue_classes_threshold():
    grid = Grid.create((24, 24, 24))
    grey, white, t1 = (torch.zeros(grid.shape) for _ in range(3))
    grey[4:20, 4:20, 4:20] = 1.0
    white[8:16, 8:16, 8:16], grey[8:16, 8:16, 8:16] = 1.0, 0.0
    grey[11:13, 11:13, 11:13], white[11:13, 11:13, 11:13] = 0.0, 0.0  # a "ventricle" inside: CSF
    t1[4:20, 4:20, 4:20] = 1.0
    t2 = t2_like(Image(t1, grid), Image(grey, grid), Image(white, grid)).data
    csf, gm, wm = float(t2[12, 12, 12]), float(t2[5, 5, 5]), float(t2[9, 9, 9])
    assert csf > gm > wm > 0
    labels, thresholds = tissue_classes(Image(torch.tensor([[0.0, 1.0], [2.0, 3.0]]), Grid.create((2, 2))))
    assert labels.data.tolist() == [[0, 1], [2, 3]] and len(thresholds) == 3


def test_run_process_reports_the_exit_code_and_kills_at_the_timeout(tmp_path: Path):
    done = run_process([sys.executable, "-c", "print('hello')"], tmp_path / "hello.log", {}, timeout=60)
    assert done["returncode"] == 0 and (tmp_path / "hello.log").read_text() == "hello\n"
    slow = run_process([sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "slow.log", {}, timeout=0.5)
    assert slow["returncode"] is None and slow["wall_s"] < 20


_TINY_2D = """
dim: 2
stages:
  - {type: moments, mode: com}
  - type: affine
    similarity: {name: ncc}
    pyramid: [{shrink: 2, smoothing: 1.0}]
    optimizer: {name: adam, learning_rate: 0.5, iterations: [15], tolerance: 1.0e-4, patience: 5}
  - type: cpab
    similarity: {name: lncc, window: 5}
    pyramid: [{shrink: 2, smoothing: 1.0}]
    optimizer: {name: adam, learning_rate: 0.05, iterations: [15], tolerance: 1.0e-4, patience: 5}
    tessellation: [4]
    steps: 5
"""


@pytest.mark.slow  # a whole benchmark run: over 30 s on 2 cores
def test_tiny_regkit_only_run_writes_the_tables(tmp_path: Path):
    config = tmp_path / "tiny.yaml"
    config.write_text(_TINY_2D)
    out = tmp_path / "bench"
    args = ["accuracy", "--pairs", "mni2d", "--deformations", "1", "--half", "all", "--tools", "regkit-lncc,ants"]
    args += ["--regkit-config", f"lncc-2d={config}", "--bench-python", str(tmp_path / "none" / "python")]
    args += ["--threads", "1", "--out", str(out), "--output", str(tmp_path / "accuracy.md")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = {row["tool"]: row for row in csv.DictReader((out / "accuracy.csv").open())}
    assert set(rows) == {"before", "truth", "regkit-lncc", "ants"}
    assert rows["ants"]["status"].startswith("not installed (no interpreter")
    ours = rows["regkit-lncc"]
    assert ours["status"] == "ok", ours
    assert float(ours["dice"]) > float(rows["before"]["dice"])
    assert float(ours["dice_tool_warp"]) == pytest.approx(float(ours["dice"]), abs=0.02)
    assert float(ours["folds"]) == 0.0 and float(ours["epe_mm"]) < float(rows["before"]["epe_mm"])
    assert float(ours["registration_s"]) > 0 and 50 < float(ours["peak_rss_mib"]) < 4000
    markdown = (tmp_path / "accuracy.md").read_text()
    assert markdown.startswith(f"# `{shlex.join(['python', '-m', 'benchmarks', *args])}`")
    assert "| tool | Dice | HD95 mm | folds | SDlogJ | EPE mm | reg s | wall s | peak RSS MiB | GPU MiB |" in markdown
    assert (out / "runs" / "mni2d-0" / "regkit-lncc" / "displacement.mha").is_file()


def test_unknown_pair_sets_and_tools_are_refused():
    result = CliRunner().invoke(app, ["accuracy", "--pairs", "2mm,3mm", "--out", "x"])
    assert result.exit_code != 0 and "give pair sets from" in result.output
    result = CliRunner().invoke(app, ["accuracy", "--tools", "ants,flirt", "--out", "x"])
    assert result.exit_code != 0 and "give tools from" in result.output
