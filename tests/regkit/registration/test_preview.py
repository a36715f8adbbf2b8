"""``register(..., on_level=...)``: the transformation reached after every pyramid level (the napari preview)."""

from __future__ import annotations

import numpy as np
import torch

from regkit.config import RegistrationConfig
from regkit.io import Image
from regkit.registration import register
from regkit.spatial.grid import Grid
from regkit.transform import Transformation


def _blob(grid: Grid, centre: tuple[float, float]) -> Image:
    world = grid.world_points(torch.float32)
    squared = ((world - torch.tensor(centre)) ** 2).sum(-1)
    return Image(torch.exp(-squared / 40.0), grid)


def _config() -> RegistrationConfig:
    levels = [{"shrink": 2, "smoothing": 1.0}, {"shrink": 1, "smoothing": 0.0}]
    optimizer = {"iterations": [3, 2], "tolerance": 0.0}
    return RegistrationConfig.model_validate(
        {
            "dim": 2,
            "device": "cpu",
            "stages": [
                {"type": "moments"},
                {"type": "affine", "similarity": {"name": "ncc"}, "pyramid": levels, "optimizer": optimizer},
                {
                    "type": "cpab",
                    "similarity": {"name": "mse"},
                    "pyramid": levels,
                    "optimizer": {**optimizer, "learning_rate": 0.2},
                    "tessellation": [2, 4],
                    "steps": 5,
                },
            ],
        }
    )


def test_on_level_reports_a_snapshot_after_every_level() -> None:
    grid = Grid.create((24, 20), (1.0, 1.5), (-3.0, 4.0))
    fixed, moving = _blob(grid, (8.0, 18.0)), _blob(grid, (10.0, 16.0))
    seen: list[tuple[Transformation, list[torch.Tensor]]] = []

    def on_level(transform: Transformation) -> None:
        seen.append((transform, [flow.theta.clone() for flow in transform.cpab]))

    result = register(fixed, moving, _config(), on_level=on_level)
    # affine: 2 levels without flows; CPAB: 2 levels with one flow on 2 x 2 then 4 x 4 cells
    assert [len(transform.cpab) for transform, _ in seen] == [0, 0, 1, 1]
    assert [transform.cpab[0].tess.shape for transform, _ in seen[2:]] == [(2, 2), (4, 4)]
    assert all(transform.fixed_grid == grid for transform, _ in seen)
    np.testing.assert_allclose(seen[1][0].matrix, result.transform.matrix)  # the affine is final after its last level
    assert not np.allclose(seen[0][0].matrix, np.eye(3))
    # the snapshots are copies: later levels did not change them, and the last one is the result
    for transform, theta in seen[2:]:
        assert torch.equal(transform.cpab[0].theta, theta[0]) and not transform.cpab[0].theta.requires_grad
    assert seen[2][0].cpab[0] is not result.transform.cpab[0]
    assert torch.equal(seen[3][0].cpab[0].theta, result.transform.cpab[0].theta)
    points = grid.world_points(torch.float64).reshape(-1, 2)
    torch.testing.assert_close(seen[3][0].transform_world(points), result.transform.transform_world(points))


def test_without_on_level_the_result_is_the_same() -> None:
    grid = Grid.create((24, 20))
    fixed, moving = _blob(grid, (8.0, 9.0)), _blob(grid, (10.0, 11.0))
    plain = register(fixed, moving, _config())
    watched = register(fixed, moving, _config(), on_level=lambda transform: None)
    np.testing.assert_array_equal(plain.transform.matrix, watched.transform.matrix)
    assert torch.equal(plain.transform.cpab[0].theta, watched.transform.cpab[0].theta)
