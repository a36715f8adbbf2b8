"""Fixtures of regkit's tests: the small registrations that regkit.results, regkit.transform and regkit.io.transforms
are checked on, run once."""

from __future__ import annotations

import pytest

from regkit.registration import register
from regkit.results import write_outputs
from regkit.spatial.grid import Grid
from tests.helpers import label_map, registration_config, rotation, scene


@pytest.fixture(scope="package", params=[2, 3], ids=["2d", "3d"])
def registration_case(request, tmp_path_factory):
    """One small 2D and one small 3D registration between different grids (the fixed one oblique, both anisotropic),
    written with both label maps: ``(result, labels, folder)``, ``labels`` the ``moving`` and ``fixed`` label maps."""
    ndim = request.param
    size = (20, 24, 28)[:ndim]
    fixed_grid = Grid.create(size, (1.5, 1.2, 1.0)[:ndim], (0.0, 0.0, 0.0)[:ndim], rotation(0.2, ndim))
    moving_grid = Grid.create((22, 22, 26)[:ndim], (1.4, 1.3, 1.1)[:ndim], (1.0, -1.0, 0.5)[:ndim])
    fixed, moving = scene(fixed_grid, 0.0), scene(moving_grid, 1.5)
    result = register(fixed, moving, registration_config(ndim))
    labels = {"moving": label_map(moving), "fixed": label_map(fixed)}
    parent = tmp_path_factory.mktemp(f"out{ndim}d")
    write_outputs(result, parent / "out", moving_labels=labels["moving"], fixed_labels=labels["fixed"])
    return result, labels, parent / "out"
