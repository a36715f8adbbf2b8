"""Fixtures of the command-line tests: a tiny 2D pair with label maps, a few bad inputs and a small configuration as
files, and one registration of it through ``regkit register``, shared by the tests of register, apply, invert,
jacobian and export."""

from __future__ import annotations

import pytest
import torch

from regkit.io import Image, write_image
from regkit.spatial.grid import Grid
from tests.helpers import gaussian_blobs, run_cli

CONFIG = """\
base: quick-2d
stages:
  - {type: moments}
  - type: affine
    similarity: {name: ncc}
    pyramid: [{shrink: 1, smoothing: 0.0}]
    optimizer: {iterations: 8}
  - type: cpab
    similarity: {name: ncc}
    pyramid: [{shrink: 1, smoothing: 0.0}]
    optimizer: {iterations: 8, learning_rate: 0.2}
    tessellation: [3]
    steps: 10
"""


def _blobs(grid: Grid, shift: float) -> Image:
    """Two Gaussian blobs, moved apart by ``shift`` mm."""
    return gaussian_blobs(grid, [(14.0 + shift, 16.0), (24.0, 10.0 - shift)], (40.0, 20.0), (1.0, 0.6))


@pytest.fixture(scope="package")
def files(tmp_path_factory):
    """A 2D pair with label maps, a few bad inputs and a small configuration, as files."""
    d = tmp_path_factory.mktemp("inputs")
    fixed_grid = Grid.create((36, 32), (1.0, 1.2), (0.0, 0.0))
    moving_grid = Grid.create((34, 34), (1.1, 1.1), (1.5, -1.0))
    fixed, moving = _blobs(fixed_grid, 0.0).data, _blobs(moving_grid, 2.0).data
    paths = {name: d / f"{name}.nii.gz" for name in ("fixed", "moving", "fl", "ml", "float_labels", "volume", "far")}
    write_image(Image(fixed, fixed_grid), paths["fixed"])
    write_image(Image(moving, moving_grid), paths["moving"])
    write_image(Image((fixed > 0.4).to(torch.int16) + (fixed > 0.8).to(torch.int16), fixed_grid), paths["fl"])
    write_image(Image((moving > 0.4).to(torch.int16) + (moving > 0.8).to(torch.int16), moving_grid), paths["ml"])
    write_image(Image(moving * 2.5, moving_grid), paths["float_labels"])
    write_image(Image(torch.rand(6, 7, 8), Grid.create((8, 7, 6))), paths["volume"])
    write_image(Image(moving, Grid.create(moving_grid.size, moving_grid.spacing, (500.0, 0.0))), paths["far"])
    paths["config"] = d / "config.yaml"
    paths["config"].write_text(CONFIG)
    paths["bad_config"] = d / "bad.yaml"
    paths["bad_config"].write_text(CONFIG.replace("steps: 10", "stpes: 10"))
    return paths


@pytest.fixture(scope="package")
def result_dir(files, tmp_path_factory):
    """One registration through main(), with both label maps and progress on."""
    out = tmp_path_factory.mktemp("result") / "out"
    argv = ["register", files["fixed"], files["moving"], "-o", out, "-c", files["config"]]
    assert run_cli([*argv, "--moving-labels", files["ml"], "--fixed-labels", files["fl"], "--seed", "3"]) == 0
    return out
