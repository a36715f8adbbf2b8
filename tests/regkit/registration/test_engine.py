"""``register``: known answers (CPAB 2D/3D, rigid, affine, LAS vs RAS), masks, bad input, cancel and progress, and the
transformation reported after every pyramid level (``on_level``, the napari preview).

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
from regkit.errors import ImageDimensionError, ImageValueError
from regkit.io import Image, reorient
from regkit.registration import Cancelled, Progress, register
from regkit.registration.stages import linear_map_problem
from regkit.spatial.affine import grid_centre
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image
from regkit.transform import Transformation
from tests.helpers import gaussian_blobs, rotation
from tests.regkit.registration.cases import cpab_stage, cpu_config, linear_stage


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


# ---- known answers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "linear", "optimizer"),
    [
        ("rigid", rotation(math.radians(6.0), 2), "adam"),
        ("affine", rotation(math.radians(-4.0), 2) @ np.array([[1.06, 0.04], [0.0, 0.95]]), "adam"),
        ("rigid", rotation(math.radians(6.0), 2), "lbfgs"),
    ],
)
def test_known_linear_transform_is_recovered(brain2d: Image, kind: str, linear: np.ndarray, optimizer: str) -> None:
    true = _about_centre(linear, np.array([5.0, -3.0]), brain2d)
    moving = _resampled(brain2d, true)
    iterations = [60, 40] if optimizer == "adam" else [20, 10]
    config = cpu_config({"type": "moments"}, linear_stage(kind, iterations, optimizer=optimizer), dim=2)
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
    config = cpu_config(cpab_stage(4, [60, 40] if ndim == 2 else [40, 20]), dim=ndim)
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
    config = cpu_config(
        {"type": "moments"}, linear_stage("affine", [10], 0.05), cpab_stage(4, [10], "lncc", 0.02), dim=3
    )
    distance = register(fixed, moving, config).transform.displacement().norm(dim=-1)
    same = register(moving, moving, config).transform.displacement().norm(dim=-1)
    # A misread orientation would flip the brain (tens of mm). Adam's first steps have the learning rate's size even
    # where the gradient is ~0, so aligned images move a little: no more than two RAS copies do (small rates here).
    assert distance.max() < 2.0 and distance.mean() < 0.5, f"LAS vs RAS: up to {distance.max():.2f} mm, not identity"
    # (the two fields live on grids whose arrays are flipped copies of each other: compare their statistics). Not
    # equal: where the gradient is ~0, the sign of rounding noise steers those first steps, and the noise depends on
    # the array layout (one torch thread: LAS vs RAS max 1.17 mm, mean 0.240; RAS vs RAS 1.64 mm, 0.253)
    assert float(distance.max()) < float(same.max()) + 0.05 and float(distance.mean()) < float(same.mean()) + 0.01


# ---- masks -------------------------------------------------------------------------------------------------------


def test_fixed_mask_restricts_the_similarity(brain2d: Image) -> None:
    """The moving image is shifted by +6 mm in x in its left half and by -6 mm in its right half: a fixed mask on
    either half makes the registration follow that half."""
    n_x = brain2d.grid.size[0]
    left = torch.arange(n_x) < n_x // 2
    plus = _resampled(brain2d, _about_centre(np.eye(2), np.array([6.0, 0.0]), brain2d)).data
    minus = _resampled(brain2d, _about_centre(np.eye(2), np.array([-6.0, 0.0]), brain2d)).data
    moving = Image(torch.where(left, plus, minus), brain2d.grid)
    config = cpu_config(linear_stage("rigid", [30, 20], 0.5), dim=2)
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
        register(brain2d, brain2d, cpu_config(linear_stage("rigid", [2]), dim=2), fixed_mask=mask)


# ---- bad input -----------------------------------------------------------------------------------------------------


def test_constant_images_do_not_crash(brain2d: Image) -> None:
    constant = Image(torch.full_like(brain2d.data, 7.0), brain2d.grid)
    config = cpu_config(linear_stage("affine", [3]), cpab_stage(2, [3]), dim=2)
    result = register(constant, brain2d, config)
    assert np.isfinite(result.transform.matrix).all()
    assert torch.isfinite(result.transform.displacement()).all()
    with_moments = cpu_config({"type": "moments"}, linear_stage("affine", [3]), dim=2)
    with pytest.raises(ImageValueError, match="fixed image is constant; moments initialisation needs some contrast"):
        register(constant, brain2d, with_moments)


def test_nan_voxels_are_refused(brain2d: Image) -> None:
    data = brain2d.data.clone()
    data[5, 5] = float("nan")
    with pytest.raises(ImageValueError, match="moving image has 1 NaN"):
        register(brain2d, Image(data, brain2d.grid), cpu_config(linear_stage("rigid", [2]), dim=2))


def test_2d_and_3d_images_are_refused(brain2d: Image, brain3d: Image) -> None:
    with pytest.raises(ImageDimensionError, match="fixed image is 2D but the moving image is 3D"):
        register(brain2d, brain3d, cpu_config(linear_stage("rigid", [2]), dim=2))
    with pytest.raises(ImageDimensionError, match="configuration is for 3D"):
        register(brain2d, brain2d, cpu_config(linear_stage("rigid", [2]), dim=3))


def test_images_with_too_few_voxels_along_an_axis_are_refused(brain2d: Image) -> None:
    thin = Image(torch.rand(3, 50), Grid.create((50, 3)))
    config = cpu_config(linear_stage("rigid", [2]), dim=2)
    with pytest.raises(
        ImageDimensionError, match=r"^the moving image has 50 x 3 voxels; registration needs at least 4"
    ):
        register(brain2d, thin, config)
    with pytest.raises(ImageDimensionError, match="the fixed image has 50 x 3 voxels"):
        register(thin, brain2d, config)


def test_linear_map_problem_names_non_finite_reflecting_and_singular_maps() -> None:
    assert linear_map_problem(np.diag([1.2, 0.8, 1.0])) is None
    assert linear_map_problem(np.diag([-1.0, 1.0, 1.0])) == (
        "ended with a map that reflects or collapses space (determinant -1)"
    )
    assert "determinant 0" in str(linear_map_problem(np.diag([0.0, 1.0, 1.0])))
    assert linear_map_problem(np.diag([np.nan, 1.0, 1.0])) == "ended with a non-finite map"


def test_a_linear_stage_that_worsens_the_similarity_is_discarded() -> None:
    """Identical images and an affine stage whose steps are far too large: the stage ends worse than the identity
    it started from, so the identity is kept and the stage's report says why."""
    grid = Grid.create((24, 20), (1.0, 1.5))
    image = _blob(grid, (8.0, 18.0))
    result = register(image, image, cpu_config(linear_stage("affine", [5], learning_rate=50.0), dim=2))
    np.testing.assert_array_equal(result.transform.matrix, np.eye(3))
    assert result.stage_warnings == [
        f"stage 0 (affine): {result.stages[0].warning}"
    ] and "the affine stage made its similarity worse" in str(result.stages[0].warning)
    assert result.stages[0].warning.endswith("the result of the earlier stages is kept")


# ---- cancel and progress -------------------------------------------------------------------------------------------


def test_should_stop_cancels(brain2d: Image) -> None:
    polls = []

    def should_stop() -> bool:
        polls.append(1)
        return len(polls) > 3

    with pytest.raises(Cancelled):
        register(brain2d, brain2d, cpu_config(linear_stage("rigid", [10]), dim=2), should_stop=should_stop)
    assert len(polls) == 4  # polled before every iteration; the fourth poll stopped it


def test_progress_reports_every_iteration(brain2d: Image) -> None:
    reports: list[Progress] = []
    config = cpu_config({"type": "moments"}, linear_stage("rigid", [4, 3]), cpab_stage(2, [5]), dim=2)
    result = register(brain2d, brain2d, config, progress=reports.append)
    assert [(p.stage, p.level, p.iteration) for p in reports] == (
        [(1, 0, i) for i in range(1, 5)] + [(1, 1, i) for i in range(1, 4)] + [(2, 0, i) for i in range(1, 6)]
    )
    assert {p.kind for p in reports} == {"rigid", "cpab"} and all(p.n_stages == 3 for p in reports)
    assert [p.cells for p in reports if p.kind == "cpab"] == [(2, 2)] * 5
    elapsed = [p.elapsed for p in reports]
    assert elapsed == sorted(elapsed) and all(math.isfinite(p.loss) for p in reports)
    assert [stage.kind for stage in result.stages] == ["moments", "rigid", "cpab"]


# ---- on_level: the transformation after every pyramid level (the napari preview) ------------------------------------


def _blob(grid: Grid, centre: tuple[float, float]) -> Image:
    return gaussian_blobs(grid, [centre], 40.0, dtype=torch.float32)


def _preview_config(cpab_learning_rate: float = 0.05) -> RegistrationConfig:
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
                    "optimizer": {**optimizer, "learning_rate": cpab_learning_rate},
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

    result = register(fixed, moving, _preview_config(), on_level=on_level)
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


def test_a_cpab_stage_that_worsens_the_similarity_is_discarded() -> None:
    """After an exact affine stage, CPAB steps that are too large leave the pair worse than they found it: the earlier
    stages' result is kept and the stage's report says so."""
    grid = Grid.create((24, 20), (1.0, 1.5), (-3.0, 4.0))
    fixed, moving = _blob(grid, (8.0, 18.0)), _blob(grid, (10.0, 16.0))
    kept = register(fixed, moving, _preview_config(0.05))
    assert len(kept.transform.cpab) == 1 and kept.stages[-1].warning is None
    worse = register(fixed, moving, _preview_config(0.2))
    assert worse.transform.cpab == []
    assert worse.stages[-1].warning is not None and "made its similarity worse" in worse.stages[-1].warning
    assert "warning" in worse.stages[-1].to_dict() and "warning" not in kept.stages[-1].to_dict()
    assert worse.stage_warnings == [f"stage 2 (cpab): {worse.stages[-1].warning}"] and kept.stage_warnings == []
    np.testing.assert_allclose(worse.transform.matrix, kept.transform.matrix)  # the same linear stages


def test_without_on_level_the_result_is_the_same() -> None:
    grid = Grid.create((24, 20))
    fixed, moving = _blob(grid, (8.0, 9.0)), _blob(grid, (10.0, 11.0))
    plain = register(fixed, moving, _preview_config())
    watched = register(fixed, moving, _preview_config(), on_level=lambda transform: None)
    np.testing.assert_array_equal(plain.transform.matrix, watched.transform.matrix)
    assert torch.equal(plain.transform.cpab[0].theta, watched.transform.cpab[0].theta)


@pytest.mark.parametrize(("ndim", "similarity"), [(2, "lncc"), (3, "lncc"), (2, "ncc"), (2, "mse"), (2, "mi")])
def test_masked_similarities_register_in_float32(brain2d: Image, brain3d: Image, ndim: int, similarity: str) -> None:
    """Brain masks on both images with every similarity in float32 (the default dtype): a finite loss and a recovered
    deformation. With the local NCC, windows beyond the masks hold only the rounding of the box sums, which must
    neither make the loss non-finite nor steer the flow."""
    fixed = brain2d if ndim == 2 else brain3d
    scale = 0.3 if ndim == 2 else 0.6
    true = _true_cpab(fixed, 4, scale, seed=ndim)
    moving = Image(true.warp(fixed.data.double(), fixed.grid, fixed.grid).float().detach(), fixed.grid)
    masks = [Image((image.data > 0.1 * image.data.max()).to(torch.uint8), image.grid) for image in (fixed, moving)]
    config = cpu_config(cpab_stage(4, [60, 40] if ndim == 2 else [40, 20], similarity), dim=ndim)
    assert config.dtype == "float32"
    result = register(fixed, moving, config, fixed_mask=masks[0], moving_mask=masks[1])
    world = fixed.grid.world_points(torch.float64)
    error, initial = _cpab_errors(result.transform.transform_world(world), true, fixed)
    assert error < 0.5 * initial, f"{ndim}D {similarity}: error {error:.2f} mm of {initial:.2f} mm"
    assert result.transform.jacobian_determinant().min() > 0


def test_without_a_configuration_the_default_of_the_dimension_runs(brain2d: Image, tmp_path, monkeypatch) -> None:
    """``register(fixed, moving)`` runs ``default_config(ndim)``, the configuration of ``regkit register`` without
    ``--config`` (a tiny one stands in for the default here)."""
    from regkit.config import DEFAULT_PRESETS, dump_config

    tiny = cpu_config(linear_stage("rigid", [3]), dim=2)
    (tmp_path / "tiny.yaml").write_text(dump_config(tiny))
    monkeypatch.setitem(DEFAULT_PRESETS, 2, str(tmp_path / "tiny.yaml"))
    assert register(brain2d, brain2d).config == tiny
