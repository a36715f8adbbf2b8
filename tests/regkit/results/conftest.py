"""The registrations of regkit.results' tests: one small 2D and one small 3D registration (oblique, anisotropic,
different fixed and moving grids), run once for the whole package and written with both label maps."""

from __future__ import annotations

import pytest
import torch

from regkit.registration import register
from regkit.results import write_outputs
from regkit.spatial.grid import Grid
from tests.regkit.results.registration_cases import label_map, registration_config, rotation, scene


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    """These problems are tiny: intra-op threads only cost time (4x on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="package", params=[2, 3], ids=["2d", "3d"])
def case(request, tmp_path_factory):
    """A registration between different oblique grids, written with both label maps: (result, labels, folder)."""
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
