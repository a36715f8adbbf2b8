"""``register``: known answers (CPAB 2D/3D, rigid, affine, LAS vs RAS), masks, bad input, cancel and progress.

Direction: the engine returns the pull-back map ``T`` (fixed world -> moving world) with ``moving(T(x)) ~ fixed(x)``.
A moving image made as ``moving(x) = fixed(S(x))`` (``S = true.warp`` or a known matrix) is registered by
``T = S^-1``: the tests compare against the inverse of the map that made the moving image.

Images are small (2D ITK brain slice at 2 mm, ~110 x 128; the bundled MNI template shrunk to 6 mm, 33 x 39 x 31) and
iterations few, so that the file runs in well under a minute on a 2-core CPU.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from regkit.config import RegistrationConfig
from regkit.cpab.module import CPAB
from regkit.demo import load_template
from regkit.errors import ImageDimensionError, ImageValueError
from regkit.io import Image, read_image, reorient
from regkit.registration import Cancelled, Progress, register
from regkit.spatial.affine import grid_centre
from regkit.spatial.sampling import sample_image
from tests.data import itk_example
from tests.regkit.registration.images import shrunk


@pytest.fixture(scope="module")
def brain2d() -> Image:
    """ITK's proton-density brain slice (20-pixel black border), 2 mm pixels: 110 x 128."""
    return shrunk(read_image(itk_example("BrainProtonDensitySliceBorder20.png")), 2)


@pytest.fixture(scope="module")
def brain3d() -> Image:
    """The bundled MNI152 T1 shrunk to 6 mm voxels: 33 x 39 x 31, RAS."""
    return shrunk(load_template(), 3)


def _config(*stages: dict, dim: int) -> RegistrationConfig:
    return RegistrationConfig.model_validate({"dim": dim, "device": "cpu", "stages": list(stages)})


def _levels(iterations: list[int]) -> list[dict]:
    """Pyramid levels for ``len(iterations)`` levels: shrink 2 then 1, or 1 alone."""
    return [{"shrink": 2, "smoothing": 1.0}, {"shrink": 1, "smoothing": 0.0}][-len(iterations) :]


def _linear_stage(kind: str, iterations: list[int], learning_rate: float = 1.0, optimizer: str = "adam") -> dict:
    return {
        "type": kind,
        "similarity": {"name": "ncc"},
        "pyramid": _levels(iterations),
        "optimizer": {"name": optimizer, "learning_rate": learning_rate, "iterations": iterations, "tolerance": 0.0},
    }


def _cpab_stage(cells: int, iterations: list[int], similarity: str = "ncc", learning_rate: float = 0.1) -> dict:
    return {
        "type": "cpab",
        "similarity": {"name": similarity},
        "pyramid": _levels(iterations),
        "tessellation": [cells] * len(iterations),
        "steps": 10,
        "optimizer": {"learning_rate": learning_rate, "iterations": iterations, "tolerance": 0.0},
        "prior": {"weight": 0.001},
    }


def _resampled(image: Image, matrix: np.ndarray) -> Image:
    """``out(x) = image(matrix x)`` on ``image``'s grid (``matrix`` homogeneous, world mm)."""
    m = torch.as_tensor(matrix, dtype=torch.float64)
    n = image.ndim
    world = image.grid.world_points(torch.float64)
    return Image(sample_image(image.data, image.grid, world @ m[:n, :n].T + m[:n, n]).float(), image.grid)


def _about_centre(linear: np.ndarray, translation: np.ndarray, image: Image) -> np.ndarray:
    """Homogeneous ``x -> linear (x - c) + c + translation`` with ``c`` the grid centre."""
    n = image.ndim
    c = grid_centre(image.grid)
    matrix = np.eye(n + 1)
    matrix[:n, :n] = linear
    matrix[:n, n] = c + translation - linear @ c
    return matrix


def _rotation2d(degrees: float) -> np.ndarray:
    a = math.radians(degrees)
    return np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])


# ---- known answers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "linear", "optimizer"),
    [
        ("rigid", _rotation2d(6.0), "adam"),
        ("affine", _rotation2d(-4.0) @ np.array([[1.06, 0.04], [0.0, 0.95]]), "adam"),
        ("rigid", _rotation2d(6.0), "lbfgs"),
    ],
)
def test_known_linear_transform_is_recovered(brain2d: Image, kind: str, linear: np.ndarray, optimizer: str) -> None:
    true = _about_centre(linear, np.array([5.0, -3.0]), brain2d)
    moving = _resampled(brain2d, true)
    iterations = [60, 40] if optimizer == "adam" else [20, 10]
    config = _config({"type": "moments"}, _linear_stage(kind, iterations, optimizer=optimizer), dim=2)
    result = register(brain2d, moving, config)
    expected = np.linalg.inv(true)
    # Compare the maps over the image: the largest disagreement at the corners of the brain's box, in mm.
    corners = brain2d.grid.index_to_world(torch.tensor([[20.0, 20.0], [90.0, 20.0], [20.0, 108.0], [90.0, 108.0]]))
    ones = torch.ones(4, 1, dtype=torch.float64)
    points = torch.cat([corners.double(), ones], dim=1).numpy()
    error = np.abs(points @ result.transform.matrix.T - points @ expected.T)[:, :2].max()
    assert error < 0.5, f"{kind}: corners off by {error:.3f} mm"


def _true_cpab(image: Image, cells: int, scale: float, seed: int) -> CPAB:
    flow = CPAB.for_grid(image.grid, cells, steps=10).double()
    return flow.sample(torch.Generator().manual_seed(seed), scale=scale)


def _cpab_errors(result_points: torch.Tensor, true: CPAB, image: Image) -> tuple[float, float]:
    """Mean endpoint error of the registration against ``true^-1`` and the mean displacement of ``true^-1``, over
    the voxels where the fixed image has signal (the background holds no information)."""
    world = image.grid.world_points(torch.float64)
    expected = true.inverse().transform_world(world).detach()
    signal = image.data > 0.1 * image.data.max()
    error = (result_points - expected).norm(dim=-1)[signal].mean().item()
    initial = (expected - world).norm(dim=-1)[signal].mean().item()
    return error, initial


@pytest.mark.parametrize("ndim", [2, 3])
def test_known_cpab_deformation_is_recovered(brain2d: Image, brain3d: Image, ndim: int) -> None:
    fixed = brain2d if ndim == 2 else brain3d
    scale = 0.3 if ndim == 2 else 0.6  # prior standard deviations: displacements of 1-2 voxels (2 mm / 6 mm)
    true = _true_cpab(fixed, 4, scale, seed=ndim)
    moving = Image(true.warp(fixed.data.double(), fixed.grid, fixed.grid).float().detach(), fixed.grid)
    config = _config(_cpab_stage(4, [60, 40] if ndim == 2 else [40, 20]), dim=ndim)
    result = register(fixed, moving, config)
    world = fixed.grid.world_points(torch.float64)
    error, initial = _cpab_errors(result.transform.transform_world(world), true, fixed)
    voxel = fixed.grid.spacing[0]
    assert initial > voxel, f"the test deformation is too small: {initial:.2f} mm"
    assert error < 0.15 * initial and error < 0.5 * voxel, f"{ndim}D: error {error:.2f} mm of {initial:.2f} mm"
    assert result.transform.jacobian_determinant().min() > 0


def test_las_and_ras_copies_register_to_the_identity(brain3d: Image) -> None:
    fixed, moving = reorient(brain3d, "LAS"), reorient(brain3d, "RAS")
    assert not torch.equal(fixed.data, moving.data)  # the arrays differ (flipped), the world images do not
    config = _config(
        {"type": "moments"}, _linear_stage("affine", [10], 0.05), _cpab_stage(4, [10], "lncc", 0.02), dim=3
    )
    distance = register(fixed, moving, config).transform.displacement().norm(dim=-1)
    same = register(moving, moving, config).transform.displacement().norm(dim=-1)
    # A misread orientation would flip the brain (tens of mm). Adam's first steps have the learning rate's size even
    # where the gradient is ~0, so aligned images move a little: exactly as much as two RAS copies (small rates here).
    assert distance.max() < 2.0 and distance.mean() < 0.5, f"LAS vs RAS: up to {distance.max():.2f} mm, not identity"
    # (the two fields live on grids whose arrays are flipped copies of each other: compare their statistics)
    assert abs(float(distance.max() - same.max())) < 0.05 and abs(float(distance.mean() - same.mean())) < 0.01


# ---- masks -------------------------------------------------------------------------------------------------------


def test_fixed_mask_restricts_the_similarity(brain2d: Image) -> None:
    """The moving image is shifted by +6 mm in x in its left half and by -6 mm in its right half: a fixed mask on
    either half makes the registration follow that half."""
    n_x = brain2d.grid.size[0]
    left = torch.arange(n_x) < n_x // 2
    plus = _resampled(brain2d, _about_centre(np.eye(2), np.array([6.0, 0.0]), brain2d)).data
    minus = _resampled(brain2d, _about_centre(np.eye(2), np.array([-6.0, 0.0]), brain2d)).data
    moving = Image(torch.where(left, plus, minus), brain2d.grid)
    config = _config(_linear_stage("rigid", [30, 20], 0.5), dim=2)
    for half, shift in ((left, 6.0), (~left, -6.0)):
        band = half & (torch.arange(n_x) - n_x // 2).abs().ge(8)  # away from the seam
        mask = Image(band.expand_as(brain2d.data).to(torch.uint8), brain2d.grid)
        result = register(brain2d, moving, config, fixed_mask=mask)
        # The fixed image's points map to moving points shifted by the inverse of the made shift.
        assert result.transform.matrix[0, 2] == pytest.approx(-shift, abs=0.5)
        assert abs(result.transform.matrix[1, 2]) < 0.5


def test_empty_mask_is_refused(brain2d: Image) -> None:
    mask = Image(torch.zeros_like(brain2d.data, dtype=torch.uint8), brain2d.grid)
    with pytest.raises(ImageValueError, match="fixed mask is empty"):
        register(brain2d, brain2d, _config(_linear_stage("rigid", [2]), dim=2), fixed_mask=mask)


# ---- bad input -----------------------------------------------------------------------------------------------------


def test_constant_images_do_not_crash(brain2d: Image) -> None:
    constant = Image(torch.full_like(brain2d.data, 7.0), brain2d.grid)
    config = _config(_linear_stage("affine", [3]), _cpab_stage(2, [3]), dim=2)
    result = register(constant, brain2d, config)
    assert np.isfinite(result.transform.matrix).all()
    assert torch.isfinite(result.transform.displacement()).all()
    with_moments = _config({"type": "moments"}, _linear_stage("affine", [3]), dim=2)
    with pytest.raises(ImageValueError, match="fixed image is constant; moments initialisation needs some contrast"):
        register(constant, brain2d, with_moments)


def test_nan_voxels_are_refused(brain2d: Image) -> None:
    data = brain2d.data.clone()
    data[5, 5] = float("nan")
    with pytest.raises(ImageValueError, match="moving image has 1 NaN"):
        register(brain2d, Image(data, brain2d.grid), _config(_linear_stage("rigid", [2]), dim=2))


def test_2d_and_3d_images_are_refused(brain2d: Image, brain3d: Image) -> None:
    with pytest.raises(ImageDimensionError, match="fixed image is 2D but the moving image is 3D"):
        register(brain2d, brain3d, _config(_linear_stage("rigid", [2]), dim=2))
    with pytest.raises(ImageDimensionError, match="configuration is for 3D"):
        register(brain2d, brain2d, _config(_linear_stage("rigid", [2]), dim=3))


# ---- cancel and progress -------------------------------------------------------------------------------------------


def test_should_stop_cancels(brain2d: Image) -> None:
    polls = []

    def should_stop() -> bool:
        polls.append(1)
        return len(polls) > 3

    with pytest.raises(Cancelled):
        register(brain2d, brain2d, _config(_linear_stage("rigid", [10]), dim=2), should_stop=should_stop)
    assert len(polls) == 4  # polled before every iteration; the fourth poll stopped it


def test_progress_reports_every_iteration(brain2d: Image) -> None:
    reports: list[Progress] = []
    config = _config({"type": "moments"}, _linear_stage("rigid", [4, 3]), _cpab_stage(2, [5]), dim=2)
    result = register(brain2d, brain2d, config, progress=reports.append)
    assert [(p.stage, p.level, p.iteration) for p in reports] == (
        [(1, 0, i) for i in range(1, 5)] + [(1, 1, i) for i in range(1, 4)] + [(2, 0, i) for i in range(1, 6)]
    )
    assert {p.kind for p in reports} == {"rigid", "cpab"} and all(p.n_stages == 3 for p in reports)
    assert [p.cells for p in reports if p.kind == "cpab"] == [(2, 2)] * 5
    elapsed = [p.elapsed for p in reports]
    assert elapsed == sorted(elapsed) and all(math.isfinite(p.loss) for p in reports)
    assert [stage.kind for stage in result.stages] == ["moments", "rigid", "cpab"]


def test_adam_steps_are_scaled_by_the_priorcoherence() -> None:
    """Adam's learning rate is divided by rms(L 1 / sigma): 1 for nearly independent coordinates, growing with the
    number of vertices one prior length scale spans."""
    from regkit.cpab.prior import VertexPrior
    from regkit.registration.stages import coherence

    independent = VertexPrior(CPAB((4, 4, 4)).basis, length_scale=0.01)
    assert coherence(independent) == pytest.approx(1.0, abs=1e-6)
    values = [coherence(VertexPrior(CPAB((n, n, n)).basis, length_scale=0.1)) for n in (6, 12, 24)]
    assert 1.0 < values[0] < values[1] < values[2]


def test_each_level_starts_from_the_coarser_solution_with_zero_z(brain2d: Image) -> None:
    """The parametrization ``theta = theta_0 + L z`` starts every level at the carried field with z = 0, so the
    level's first steps are not pulled by the prior energy of the carried field."""
    from torch.nn.utils import parametrize

    from regkit.cpab.prior import VertexPrior
    from regkit.registration.stages import Unwhiten

    flow = CPAB.for_grid(brain2d.grid, (8, 8))
    with torch.no_grad():
        flow.theta.normal_(generator=torch.Generator().manual_seed(0))
    start = flow.theta.detach().clone()
    parametrize.register_parametrization(flow, "theta", Unwhiten(flow, VertexPrior(flow.basis)))
    assert torch.count_nonzero(flow.get_parameter("parametrizations.theta.original")) == 0
    torch.testing.assert_close(flow.theta, start)


def test_stages_with_one_pyramid_share_its_levels(brain2d: Image) -> None:
    from regkit.registration.levels import RunContext

    config = _config(_linear_stage("affine", [2, 2]), _cpab_stage(2, [2, 2]), dim=2)
    ctx = RunContext(brain2d, brain2d, config, None, None, torch.device("cpu"), None, None, None)
    assert ctx.levels(config.stages[0]) is ctx.levels(config.stages[1])
