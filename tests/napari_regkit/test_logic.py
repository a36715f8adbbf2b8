"""The napari plugin's logic, without napari: frames, deformed grid, Jacobian, tessellation, velocity, flow, tiles."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from napari_regkit._logic import (
    RunSettings,
    build_config,
    checkerboard,
    comparison,
    comparison_layer,
    deformed_grid_lines,
    difference,
    flow_at,
    flow_frame,
    grid_from_napari_affine,
    grid_step,
    jacobian_layer,
    napari_affine,
    parse_schedule,
    progress_fraction,
    progress_text,
    result_layers,
    run_registration,
    save_animation,
    tessellation_lines,
    to_napari,
    velocity_vectors,
    warped_layer,
)
from regkit.config import CpabStage, LnccSimilarity, MomentsStage, RegistrationConfig, load_config
from regkit.cpab.module import CPAB
from regkit.errors import ConfigError, GeometryError, RegkitError
from regkit.io import Image, RegistrationInputs
from regkit.registration import Cancelled, Progress, RegistrationResult
from regkit.results import resample
from regkit.spatial.grid import Grid
from regkit.transform import Transformation
from tests.helpers import rotation


def _oblique_grid() -> Grid:
    return Grid.create((7, 5, 4), (1.5, 0.8, 2.0), (10.0, -20.0, 5.5), rotation(0.3, 3) @ np.diag([1.0, -1.0, -1.0]))


def _random_cpab(grid: Grid, seed: int = 0) -> CPAB:
    cpab = CPAB.for_grid(grid, 2).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        cpab.theta.copy_(torch.randn(cpab.theta.shape, generator=generator, dtype=torch.float64))
    return cpab


def _translation(ndim: int, shift: list[float]) -> np.ndarray:
    matrix = np.eye(ndim + 1)
    matrix[:ndim, ndim] = shift
    return matrix


def test_napari_affine_maps_data_coordinates_to_reversed_world() -> None:
    grid = _oblique_grid()
    affine = napari_affine(grid)
    index = torch.tensor([[0.0, 0.0, 0.0], [6.0, 4.0, 3.0], [2.5, 1.0, 0.5]], dtype=torch.float64)  # (i, j, k)
    data = np.concatenate([index.numpy()[:, ::-1], np.ones((3, 1))], axis=1)  # (k, j, i, 1)
    expected = to_napari(grid.index_to_world(index))
    np.testing.assert_allclose((data @ affine.T)[:, :3], expected, atol=1e-12)


def test_grid_from_napari_affine_inverts_napari_affine() -> None:
    grid = _oblique_grid()
    back = grid_from_napari_affine(napari_affine(grid), grid.shape)
    assert back.size == grid.size
    np.testing.assert_allclose(back.affine(), grid.affine(), atol=1e-12)


def test_grid_from_napari_affine_refuses_shear() -> None:
    affine = np.eye(3)
    affine[0, 1] = 0.5
    with pytest.raises(GeometryError):
        grid_from_napari_affine(affine, (4, 5))


def test_to_napari_reverses_the_last_axis() -> None:
    points = np.arange(12.0).reshape(2, 2, 3)
    np.testing.assert_array_equal(to_napari(torch.from_numpy(points)), points[..., ::-1])


def test_deformed_grid_lines_identity_lie_on_the_grid() -> None:
    grid = Grid.create((9, 6), (1.0, 2.0), (3.0, 4.0))
    lines = deformed_grid_lines(Transformation(grid, np.eye(3)), grid, 4)
    # along x: lines at j = 0, 4 (2 lines of 9 points); along y: lines at i = 0, 4, 8 (3 lines of 6 points)
    assert [line.shape for line in lines] == [(9, 2)] * 2 + [(6, 2)] * 3
    np.testing.assert_allclose(lines[1][:, 0], 4.0 + 2.0 * 4)  # napari (y, x): y of the row j = 4
    np.testing.assert_allclose(lines[1][:, 1], 3.0 + np.arange(9))
    np.testing.assert_allclose(lines[4][:, 1], 3.0 + 8)


def test_deformed_grid_lines_follow_the_transformation() -> None:
    grid = _oblique_grid()
    transform = Transformation(grid, _translation(3, [1.0, -2.0, 0.5]), [_random_cpab(grid)])
    lines = deformed_grid_lines(transform, grid, 3)
    assert len(lines) == 2 * 2 + 3 * 2 + 3 * 2  # (j, k) in {0,3}x{0,3}; (i, k) in {0,3,6}x{0,3}; (i, j) {0,3,6}x{0,3}
    first = grid.index_to_world(torch.stack([torch.arange(7.0), torch.zeros(7), torch.zeros(7)], dim=-1).double())
    np.testing.assert_allclose(lines[0], to_napari(transform.transform_world(first)), atol=1e-10)
    assert np.abs(lines[0] - to_napari(first)).max() > 0.1


def test_deformed_grid_lines_refuse_zero_spacing() -> None:
    grid = Grid.create((4, 4))
    with pytest.raises(ValueError, match="spacing_vox"):
        deformed_grid_lines(Transformation(grid, np.eye(3)), grid, 0)


def test_jacobian_layer_identity_and_reflection() -> None:
    grid = Grid.create((5, 4))
    det, limits, folded = jacobian_layer(Transformation(grid, np.eye(3)))
    assert det.shape == grid.shape and det.dtype == np.float32
    np.testing.assert_allclose(det, 1.0)
    assert limits[0] < 1.0 < limits[1] and np.isclose(limits[0] + limits[1], 2.0)
    assert not folded.any()
    _, limits, folded = jacobian_layer(Transformation(grid, np.diag([-1.0, 1.0, 1.0])))
    assert folded.all()
    assert np.isclose(limits[0], -1.0) and np.isclose(limits[1], 3.0)


def test_jacobian_layer_of_a_cpab_is_positive() -> None:
    grid = Grid.create((8, 6))
    det, limits, folded = jacobian_layer(Transformation(grid, np.eye(3), [_random_cpab(grid)]))
    assert (det > 0).all() and not folded.any()
    assert limits[0] <= det.min() and det.max() <= limits[1]


def test_tessellation_lines_2d_edges_once_in_world() -> None:
    grid = Grid.create((6, 9), (1.0, 1.0), (10.0, 20.0))
    cpab = CPAB.for_grid(grid, (2, 3))
    lines = tessellation_lines(cpab)
    # rectangle edges: 2 * 4 along x, 3 * 3 along y; plus 4 spokes to each of the 6 centres
    assert lines.shape == (8 + 9 + 24, 2, 2)
    assert len({tuple(sorted(map(tuple, edge.round(9)))) for edge in lines}) == len(lines)
    np.testing.assert_allclose(lines.reshape(-1, 2).min(axis=0), [19.5, 9.5])  # napari (y, x): the voxel edges
    np.testing.assert_allclose(lines.reshape(-1, 2).max(axis=0), [28.5, 15.5])


def test_tessellation_lines_3d() -> None:
    cpab = CPAB.for_grid(_oblique_grid(), 1)
    lines = tessellation_lines(cpab)
    # one cube, 5 tetrahedra: its 12 edges and the 6 face diagonals of the central tetrahedron
    assert lines.shape == (18, 2, 3)
    corners = cpab.domain_to_world(cpab.tess.vertices())
    assert {tuple(p) for p in lines.reshape(-1, 3).round(9)} == {tuple(p) for p in to_napari(corners).round(9)}


def test_velocity_vectors() -> None:
    grid = _oblique_grid()
    cpab = _random_cpab(grid)
    vectors = velocity_vectors(cpab, grid, 3)
    assert vectors.shape == (3 * 2 * 2, 2, 3)
    starts = grid.index_to_world(torch.tensor([[3.0, 0.0, 0.0]], dtype=torch.float64))
    np.testing.assert_allclose(vectors[1, 0], to_napari(starts)[0])  # x varies fastest
    # the velocity is the derivative of the flow at t = 0, in world millimetres
    h = 1e-5
    derivative = (cpab.transform_world(starts, t=h) - starts) / h
    np.testing.assert_allclose(vectors[1, 1], to_napari(derivative)[0], rtol=1e-3, atol=1e-6)
    zero = CPAB.for_grid(grid, 2)
    assert not velocity_vectors(zero, grid, 2)[:, 1].any()


def test_flow_at_ends_and_middle() -> None:
    grid = _oblique_grid()
    cpab = _random_cpab(grid)
    transform = Transformation(grid, _translation(3, [2.0, 0.0, -1.0]), [cpab])
    points = grid.world_points(torch.float64).reshape(-1, 3)
    torch.testing.assert_close(flow_at(transform, 0.0).transform_world(points), points)
    torch.testing.assert_close(flow_at(transform, 1.0).transform_world(points), transform.transform_world(points))
    halfway = cpab.transform_world(points, t=0.5) + torch.tensor([1.0, 0.0, -0.5], dtype=torch.float64)
    torch.testing.assert_close(flow_at(transform, 0.5).transform_world(points), halfway)
    assert torch.equal(cpab.theta, transform.cpab[0].theta)  # the original is untouched
    with pytest.raises(ValueError, match="t must"):
        flow_at(transform, 1.5)


def test_checkerboard() -> None:
    fixed = np.zeros((4, 6), dtype=np.int16)
    fixed[0, 0] = 10
    warped = np.full((4, 6), 5.0)
    warped[0, 0] = 7.0
    board = checkerboard(fixed, warped, 2)
    assert board.shape == (4, 6) and board.dtype == np.float32
    tiles_from_fixed = np.add.outer(np.arange(4) // 2, np.arange(6) // 3) % 2 == 0
    expected = np.where(tiles_from_fixed, (fixed == 10).astype(np.float32), (warped - 5.0) / 2.0)
    np.testing.assert_allclose(board, expected)
    with pytest.raises(ValueError, match="same shape"):
        checkerboard(fixed, warped[:2], 2)


def test_deformed_grid_lines_inverse_undoes_the_transformation() -> None:
    grid = _oblique_grid()
    transform = Transformation(grid, _translation(3, [1.0, -2.0, 0.5]), [_random_cpab(grid)])
    straight = deformed_grid_lines(Transformation(grid, np.eye(4)), grid, 3)
    carried = deformed_grid_lines(transform, grid, 3, inverse=True)
    back = transform.transform_world(torch.from_numpy(to_napari(np.concatenate(carried))))
    np.testing.assert_allclose(to_napari(back), np.concatenate(straight), atol=1e-3)


def test_difference_and_comparison() -> None:
    fixed = np.array([[0.0, 2.0], [4.0, 4.0]])
    warped = np.array([[1.0, 1.0], [3.0, 1.0]])
    np.testing.assert_allclose(difference(fixed, warped), [[0.0, -0.5], [0.0, -1.0]])
    np.testing.assert_array_equal(comparison(fixed, warped, "difference"), difference(fixed, warped))
    np.testing.assert_array_equal(comparison(fixed, warped, "checkerboard", 2), checkerboard(fixed, warped, 2))
    with pytest.raises(ValueError, match="view"):
        comparison(fixed, warped, "blend")
    grid = Grid.create((2, 2), (2.0, 3.0))
    board, meta, kind = comparison_layer(Image(torch.from_numpy(fixed), grid), warped, "difference")
    assert kind == "image" and meta["name"] == "comparison" and meta["contrast_limits"] == (-1.0, 1.0)
    np.testing.assert_array_equal(board, difference(fixed, warped))
    np.testing.assert_array_equal(meta["affine"], napari_affine(grid))


# ---- the registration widget's logic ---------------------------------------------------------------------------------


def test_parse_schedule() -> None:
    assert parse_schedule("4, 8,16") == (4, 8, 16)
    assert parse_schedule(" 6 12 ") == (6, 12)
    assert parse_schedule("") == ()
    for bad in ("4, x", "0, 4", "-4", "4.5"):
        with pytest.raises(ConfigError, match="tessellation"):
            parse_schedule(bad)


def test_build_config_defaults_to_the_preset_for_the_dimension() -> None:
    assert build_config(RunSettings(), 2) == load_config("image-2d")
    assert build_config(RunSettings(), 3) == load_config("brain-mri-3d")


def test_build_config_overrides_the_main_settings() -> None:
    settings = RunSettings(config="quick-2d", tessellation=(3,), similarity="mse", iterations=7, device="cpu")
    config = build_config(settings, 2)
    base = load_config("quick-2d")
    assert isinstance(config.stages[0], MomentsStage) and config.stages[0] == base.stages[0]
    for stage in config.stages[1:]:
        assert stage.similarity.name == "mse" and stage.level_iterations() == (7, 7)
        assert stage.pyramid == base.stages[1].pyramid
    cpab = config.stages[-1]
    assert isinstance(cpab, CpabStage) and cpab.tessellation == (3, 3) and cpab.steps == 5
    assert config.device == "cpu"
    schedule = build_config(RunSettings(config="quick-2d", tessellation=(2, 6)), 2).stages[-1]
    assert isinstance(schedule, CpabStage) and schedule.tessellation == (2, 6)


def test_build_config_keeps_the_options_of_the_same_similarity(tmp_path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("base: histology-2d\ndevice: cpu\n")
    config = build_config(RunSettings(config=path, similarity="lncc"), 2)
    cpab = config.stages[-1]
    assert isinstance(cpab.similarity, LnccSimilarity) and cpab.similarity.window == 9  # the preset's window
    assert config.device == "cpu"


def test_build_config_errors_name_the_override() -> None:
    with pytest.raises(ConfigError, match=r"overrides.*tessellation"):
        build_config(RunSettings(config="quick-2d", tessellation=(2, 4, 8)), 2)
    with pytest.raises(ConfigError, match="neither a YAML file nor a preset"):
        build_config(RunSettings(config="no-such-preset"), 2)


def _progress(**changes) -> Progress:
    values = dict(
        stage=2,
        n_stages=3,
        kind="cpab",
        level=1,
        n_levels=2,
        iteration=5,
        max_iterations=10,
        loss=0.5,
        similarity=0.123456,
        elapsed=1.0,
        cells=(8, 8),
    )
    return Progress(**(values | changes))


def test_progress_text_and_fraction() -> None:
    text = progress_text(_progress())
    assert text == "stage 3/3 cpab, level 2/2, 8 x 8 cells, iteration 5/10, similarity 0.1235"
    assert "cells" not in progress_text(_progress(kind="affine", cells=None))
    assert progress_fraction(_progress()) == pytest.approx((2 + (1 + 0.5) / 2) / 3)
    assert progress_fraction(_progress(stage=0, level=0, iteration=0)) == 0.0
    assert progress_fraction(_progress(level=1, iteration=10)) == 1.0


def test_grid_step() -> None:
    grid = Grid.create((100, 40))
    assert grid_step(grid, 10) == 10
    assert grid_step(grid, 16) == 7
    assert grid_step(grid, 1000) == 1
    with pytest.raises(ValueError, match="lines"):
        grid_step(grid, 0)


def _result(chain: int = 1) -> RegistrationResult:
    fixed_grid = Grid.create((12, 10), (1.5, 2.0), (3.0, -4.0))
    moving_grid = Grid.create((14, 9), (1.0, 2.5), (2.0, -5.0))
    generator = torch.Generator().manual_seed(0)
    moving = Image(torch.rand(moving_grid.shape, generator=generator), moving_grid)
    flows = [_random_cpab(fixed_grid, seed) for seed in range(chain)]
    config = load_config("quick-2d")
    return RegistrationResult(
        Transformation(fixed_grid, _translation(2, [0.5, -1.0]), flows),
        Image(torch.rand(fixed_grid.shape, generator=generator), fixed_grid),
        moving,
        config,
        stages=[],
        device="cpu",
        seconds=0.0,
        peak_memory_bytes=None,
    )


def test_warped_layer_is_placed_on_the_fixed_grid() -> None:
    result = _result()
    data, meta, kind = warped_layer(result.transform, result.moving, "moving warped")
    assert kind == "image" and meta["name"] == "moving warped"
    np.testing.assert_array_equal(data, resample(result.transform, result.moving).data.numpy())
    np.testing.assert_array_equal(meta["affine"], napari_affine(result.fixed.grid))
    labels = Image((result.moving.data > 0.5).to(torch.int16), result.moving.grid)
    data, _, kind = warped_layer(result.transform, labels, "labels warped", labels=True)
    assert kind == "labels" and data.dtype == np.int16 and set(np.unique(data)) <= {0, 1}


def test_result_layers() -> None:
    result = _result()
    labels = Image((result.moving.data > 0.5).to(torch.uint8), result.moving.grid)
    layers = result_layers(result, "mov", ("seg", labels), grid_lines=4)
    assert [(meta["name"], kind) for _, meta, kind in layers] == [
        ("mov warped", "image"),
        ("seg warped", "labels"),
        ("deformed grid", "shapes"),
        ("Jacobian determinant", "image"),
        ("folding (det <= 0)", "labels"),
        ("tessellation", "vectors"),
        ("velocity", "vectors"),
    ]
    grid = result.fixed.grid
    for data, meta, _ in (layers[0], layers[1], layers[3], layers[4]):
        assert data.shape == grid.shape
        np.testing.assert_array_equal(meta["affine"], napari_affine(grid))
    step = grid_step(grid, 4)
    assert step == 3
    lines = deformed_grid_lines(result.transform, grid, step)
    assert len(layers[2][0]) == len(lines) and layers[2][1]["shape_type"] == "path"
    det, limits, _ = jacobian_layer(result.transform)
    np.testing.assert_array_equal(layers[3][0], det)
    assert layers[3][1]["contrast_limits"] == limits and layers[3][1]["colormap"] == "PiYG"
    assert layers[4][0].dtype == np.uint8 and not layers[4][0].any()
    edges = tessellation_lines(result.transform.cpab[0])
    np.testing.assert_allclose(layers[5][0][:, 0] + layers[5][0][:, 1], edges[:, 1])
    np.testing.assert_array_equal(layers[6][0], velocity_vectors(result.transform.cpab[0], grid, step))


def test_result_layers_of_chains_and_of_linear_results() -> None:
    names = [meta["name"] for _, meta, _ in result_layers(_result(chain=2), "m")]
    assert names[-3:] == ["tessellation", "velocity 1", "velocity 2"]
    linear = _result(chain=0)
    names = [meta["name"] for _, meta, _ in result_layers(linear, "m")]
    assert names == ["m warped", "deformed grid", "Jacobian determinant", "folding (det <= 0)"]


def _quick_config() -> RegistrationConfig:
    levels = [{"shrink": 2, "smoothing": 1.0}, {"shrink": 1, "smoothing": 0.0}]
    optimizer = {"iterations": 2, "tolerance": 0.0}
    stages = [
        {"type": "affine", "similarity": {"name": "ncc"}, "pyramid": levels, "optimizer": optimizer},
        {
            "type": "cpab",
            "similarity": {"name": "ncc"},
            "pyramid": levels,
            "optimizer": optimizer,
            "tessellation": [2, 2],
            "steps": 5,
        },
    ]
    return RegistrationConfig.model_validate({"dim": 2, "device": "cpu", "stages": stages})


def test_run_registration_previews_every_level_and_builds_the_layers() -> None:
    grid = Grid.create((20, 16))
    world = grid.world_points(torch.float32)
    fixed = Image(torch.exp(-((world - torch.tensor([9.0, 7.0])) ** 2).sum(-1) / 20), grid)
    moving = Image(torch.exp(-((world - torch.tensor([10.0, 8.0])) ** 2).sum(-1) / 20), grid)
    labels = Image((moving.data > 0.3).to(torch.uint8), grid)
    previews, reports = [], []
    run = run_registration(
        RegistrationInputs(fixed, moving, moving_labels=labels),
        _quick_config(),
        moving_name="m",
        labels_name="l",
        grid_lines=5,
        progress=reports.append,
        preview=previews.append,
    )
    assert [meta["name"] for _, meta, _ in previews] == ["m warped"] * 4
    np.testing.assert_array_equal(previews[-1][0], run.layers[0][0])
    assert len(reports) == 8 and run.moving_labels is labels
    assert [meta["name"] for _, meta, _ in run.layers][:2] == ["m warped", "l warped"]
    with pytest.raises(Cancelled):
        run_registration(RegistrationInputs(fixed, moving), _quick_config(), moving_name="m", should_stop=lambda: True)


# ---- the inspect widget's logic --------------------------------------------------------------------------------------


def test_flow_frame_from_identity_to_the_transformation() -> None:
    result = _result()
    transform, moving = result.transform, result.moving
    grid = transform.fixed_grid
    start = flow_frame(transform, moving, 0.0, 3)
    identity = Transformation(grid, np.eye(3))
    assert start.t == 0.0 and start.image.dtype == np.float32 and start.image.shape == grid.shape
    np.testing.assert_allclose(start.image, resample(identity, moving).data.numpy(), atol=1e-6)
    for line, straight in zip(start.grid_lines, deformed_grid_lines(identity, grid, 3), strict=True):
        np.testing.assert_allclose(line, straight, atol=1e-9)
    end = flow_frame(transform, moving, 1.0, 3)
    np.testing.assert_allclose(end.image, resample(transform, moving).data.numpy(), atol=1e-6)
    for line, carried in zip(end.grid_lines, deformed_grid_lines(transform, grid, 3, inverse=True), strict=True):
        np.testing.assert_allclose(line, carried, atol=1e-9)
    middle = flow_frame(transform, moving, 0.5, 3)
    np.testing.assert_allclose(middle.image, resample(flow_at(transform, 0.5), moving).data.numpy(), atol=1e-6)


def test_save_animation_gif(tmp_path) -> None:
    from PIL import Image as PILImage

    frames = [np.full((20, 30, 4), value, dtype=np.uint8) for value in (0, 120, 250)]
    path = save_animation(frames, tmp_path / "flow.gif", fps=5)
    with PILImage.open(path) as gif:
        assert gif.n_frames == 3 and gif.size == (30, 20)
        assert gif.info["duration"] == 200 and gif.info["loop"] == 0
        gif.seek(1)
        assert np.asarray(gif.convert("RGB"))[0, 0].tolist() == [120, 120, 120]


def test_save_animation_refuses_what_it_cannot_write(tmp_path) -> None:
    frames = [np.zeros((8, 8, 3), np.uint8)]
    with pytest.raises(RegkitError, match=r"flow\.avi.*use \.gif or \.mp4"):
        save_animation(frames, tmp_path / "flow.avi")
    with pytest.raises(ValueError, match="no frames"):
        save_animation([], tmp_path / "flow.gif")
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        with pytest.raises(RegkitError, match="imageio-ffmpeg"):
            save_animation(frames, tmp_path / "flow.mp4")


def test_save_animation_mp4(tmp_path) -> None:
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")
    frames = [np.full((21, 33, 4), value, dtype=np.uint8) for value in range(0, 250, 25)]  # odd sides are cropped
    path = save_animation(frames, tmp_path / "flow.mp4", fps=5)
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    assert meta["size"] == (32, 20) and meta["fps"] == 5
    assert sum(1 for _ in reader) == 10


def test_the_logic_imports_neither_napari_nor_qt() -> None:
    code = (
        "import sys, napari_regkit._logic, napari_regkit._io; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'napari', 'PyQt6', 'PyQt5', 'qtpy', 'magicgui'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
