"""regkit.spatial.sampling.sample_image: voxel centres, oblique grids, translations, padding, size-1 axes, gradients."""

from __future__ import annotations

import pytest
import torch

from regkit.errors import ImageDimensionError
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image
from tests.helpers import rotation


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_voxel_centres_return_the_voxels_on_an_oblique_grid(ndim: int, mode: str) -> None:
    size = (5, 4, 3)[:ndim]
    grid = Grid.create(
        size, spacing=(0.7, 1.3, 2.0)[:ndim], origin=(10.0, -4.0, 3.0)[:ndim], direction=rotation(0.3, ndim, tilt=0.4)
    )
    image = torch.randn(grid.shape, dtype=torch.float64)
    values = sample_image(image, grid, grid.world_points(torch.float64), mode=mode)
    torch.testing.assert_close(values, image, rtol=0, atol=1e-12)


def test_channels_and_batch_shape() -> None:
    grid = Grid.create((6, 5, 4), spacing=(1.0, 2.0, 3.0))
    image = torch.randn(2, *grid.shape, dtype=torch.float64)
    points = grid.world_points(torch.float64)[:2, :3]  # (2, 3, 6, 3)
    values = sample_image(image, grid, points)
    assert values.shape == (2, *points.shape[:-1])
    torch.testing.assert_close(values, image[:, :2, :3])


def test_known_translation_of_a_linear_ramp() -> None:
    """A linear image is reproduced exactly by linear interpolation, so a shift by d mm adds slope * d."""
    grid = Grid.create((8, 7), spacing=(2.0, 0.5), origin=(-3.0, 5.0), direction=rotation(0.5, 2, tilt=0.4))
    world = grid.world_points(torch.float64)
    slope = torch.tensor([0.3, -1.1], dtype=torch.float64)
    image = world @ slope
    shift = torch.tensor([0.37, -0.21], dtype=torch.float64)
    inner = grid.index_points(torch.float64)
    keep = ((inner > 1) & (inner < torch.tensor(grid.size) - 2)).all(-1)  # stay well inside after the shift
    values = sample_image(image, grid, world[keep] + shift)
    torch.testing.assert_close(values, image[keep] + shift @ slope, rtol=0, atol=1e-12)


def test_nearest_picks_the_nearest_voxel_and_keeps_integer_labels() -> None:
    grid = Grid.create((4, 3), spacing=(2.0, 1.0))
    labels = torch.arange(12, dtype=torch.int32).reshape(grid.shape)
    index = torch.tensor([[0.4, 0.0], [1.6, 1.2], [2.9, 1.9]], dtype=torch.float64)
    values = sample_image(labels, grid, grid.index_to_world(index), mode="nearest")
    assert values.dtype == torch.int32
    assert values.tolist() == [labels[0, 0].item(), labels[1, 2].item(), labels[2, 3].item()]


def test_padding_outside_and_half_voxel_fade() -> None:
    grid = Grid.create((3, 3))
    image = torch.full(grid.shape, 4.0, dtype=torch.float64)
    index = torch.tensor([[-0.5, 1.0], [-2.0, 1.0], [1.0, 2.25], [1.0, 1.0]], dtype=torch.float64)
    values = sample_image(image, grid, grid.index_to_world(index), padding=-1.0)
    torch.testing.assert_close(values, torch.tensor([1.5, -1.0, 2.75, 4.0], dtype=torch.float64))
    nearest = sample_image(image, grid, grid.index_to_world(index), mode="nearest", padding=-1.0)
    assert nearest.tolist() == [4.0, -1.0, 4.0, 4.0]  # -0.5 rounds to even (0); 2.25 rounds to 2


def test_single_slice_axis_behaves_like_the_others() -> None:
    grid = Grid.create((4, 3, 1), spacing=(1.0, 1.0, 2.5))
    image = torch.randn(grid.shape, dtype=torch.float64)
    index = torch.tensor([[1.0, 2.0, 0.0], [1.0, 2.0, 0.25], [1.0, 2.0, -1.5]], dtype=torch.float64)
    values = sample_image(image, grid, grid.index_to_world(index))
    v = image[0, 2, 1]
    torch.testing.assert_close(values, torch.stack([v, 0.75 * v, torch.zeros_like(v)]))


def test_gradcheck_wrt_points_and_image() -> None:
    grid = Grid.create((4, 5, 3), spacing=(1.0, 0.8, 1.5), direction=rotation(0.2, 3, tilt=0.4))
    image = torch.randn(grid.shape, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0.3, 1.2, 0.7], [2.6, 3.1, 1.4], [1.45, 0.2, 1.9]], dtype=torch.float64)
    points = grid.index_to_world(index).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda p, im: sample_image(im, grid, p), (points, image))


def test_shape_errors() -> None:
    grid = Grid.create((4, 5))
    with pytest.raises(ImageDimensionError, match="does not match grid"):
        sample_image(torch.zeros(4, 5), grid, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="world points"):
        sample_image(torch.zeros(5, 4), grid, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="sampling mode"):
        sample_image(torch.zeros(5, 4), grid, torch.zeros(3, 2), mode="cubic")


@pytest.mark.parametrize("size", [(7, 6, 5), (9, 8), (6, 1, 5)])
def test_linear_numba_face_equals_grid_sample(size, monkeypatch):
    """The numba face (what ``auto`` takes on the CPU for images needing no gradient) against the grid_sample face:
    values and point gradients, points inside, on borders and outside, channels, an axis of size 1; an image that
    needs a gradient takes the grid_sample face and gets its gradient."""
    import regkit.spatial.sampling as sampling

    generator = torch.Generator().manual_seed(3)
    grid = Grid.create(size, spacing=[1.5, 0.8, 1.2][: len(size)], origin=[3.0, -2.0, 1.0][: len(size)])
    image = torch.randn(2, *grid.shape, generator=generator, dtype=torch.float64)
    index = (
        torch.rand(300, len(size), generator=generator, dtype=torch.float64)
        * (torch.tensor(size, dtype=torch.float64) + 2)
        - 1.5
    )
    index[:10] = torch.tensor([s - 1 for s in size], dtype=torch.float64)  # the last voxel centre
    points = grid.index_to_world(index)
    results = []
    for faces in (("torch",), ("torch", "numba")):
        monkeypatch.setattr(sampling, "_LINEAR_FACES", faces)
        p = points.clone().requires_grad_(True)
        out = sample_image(image, grid, p, padding=0.5)
        (grad,) = torch.autograd.grad((out * out).sum(), p)
        results.append((out.detach(), grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-8, atol=1e-8)
    trainable = image.clone().requires_grad_(True)
    (image_grad,) = torch.autograd.grad(sample_image(trainable, grid, points).sum(), trainable)
    assert image_grad.abs().sum() > 0
