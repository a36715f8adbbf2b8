"""``benchmarks.diffeomorphism``: the float64 reference of a transformation, by an independent integration scheme,
agrees with regkit's own evaluation (the jump check compares the two around the largest second difference)."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.diffeomorphism import reference_world
from regkit.cpab.module import CPAB
from regkit.spatial.grid import Grid
from regkit.transform import Transformation


def test_reference_world_is_the_transformation_by_another_scheme() -> None:
    grid = Grid.create((12, 10), (2.0, 1.5), (-4.0, 3.0), np.eye(2))
    flow = CPAB.for_grid(grid, 3).double()
    with torch.no_grad():
        flow.theta.copy_(torch.randn(flow.theta.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    matrix = np.eye(3)
    matrix[:2, 2] = [1.0, -2.0]
    transform = Transformation(grid, matrix, [flow])
    world = grid.world_points(torch.float64).reshape(-1, 2)
    moved = transform.transform_world(world)
    assert (moved - world).norm(dim=-1).max() > 1.0  # a deformation worth checking, facets crossed
    torch.testing.assert_close(reference_world(transform, world), moved, atol=1e-6, rtol=0)
