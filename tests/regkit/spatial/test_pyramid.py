"""Image pyramids: ITK shrink geometry, sampled values, smoothing per level."""

import numpy as np
import pytest
import SimpleITK as sitk
import torch

from regkit.spatial.filters import gaussian_smooth
from regkit.spatial.grid import Grid
from regkit.spatial.pyramid import build_pyramid, downsample, shrink_grid

OBLIQUE = np.array([[0.0, -1.0, 0.0], [0.8, 0.0, 0.6], [-0.6, 0.0, 0.8]])


def sitk_image(grid):
    img = sitk.Image([int(s) for s in grid.size], sitk.sitkFloat32)
    img.SetSpacing(grid.spacing)
    img.SetOrigin(grid.origin)
    img.SetDirection(np.asarray(grid.direction).ravel().tolist())
    return img


@pytest.mark.parametrize(
    "size, shrink",
    [((20, 24, 16), 2), ((21, 25, 17), (2, 3, 4)), ((7, 9, 5), 4), ((3, 9, 10), (5, 1, 3)), ((16, 12), (4, 3))],
)
def test_shrink_grid_matches_simpleitk(size, shrink):
    n = len(size)
    grid = Grid.create(size, (0.9, 1.1, 2.0)[:n], (10.0, -20.0, 5.0)[:n], OBLIQUE if n == 3 else [[0, 1], [-1, 0]])
    coarse = shrink_grid(grid, shrink)
    factors = [shrink] * n if isinstance(shrink, int) else list(shrink)
    ref = sitk.Shrink(sitk_image(grid), factors)
    assert coarse.size == ref.GetSize()
    np.testing.assert_allclose(coarse.spacing, ref.GetSpacing(), rtol=1e-12)
    np.testing.assert_allclose(coarse.origin, ref.GetOrigin(), atol=1e-9)
    np.testing.assert_allclose(np.asarray(coarse.direction).ravel(), ref.GetDirection(), atol=1e-12)


def test_coarse_voxels_sit_at_block_centres_and_share_the_centre():
    grid = Grid.create((24, 18, 12), (1.0, 1.5, 2.5), (3.0, -4.0, 7.0), OBLIQUE)
    coarse = shrink_grid(grid, (4, 3, 2))
    j = torch.tensor([[0, 0, 0], [5, 5, 5], [2, 1, 3]], dtype=torch.float64)
    fine_index = j * torch.tensor([4.0, 3.0, 2.0]) + torch.tensor([1.5, 1.0, 0.5])
    torch.testing.assert_close(coarse.index_to_world(j), grid.index_to_world(fine_index))
    # the same centre and, as the factors divide the size, the same world extent (the boxes of the voxels)
    for index in ((torch.tensor(grid.size) - 1) / 2, torch.full((3,), -0.5), torch.tensor(grid.size) - 0.5):
        coarse_index = (index + 0.5) / torch.tensor([4.0, 3.0, 2.0]) - 0.5
        torch.testing.assert_close(coarse.index_to_world(coarse_index.double()), grid.index_to_world(index.double()))


@pytest.mark.parametrize("size, shrink", [((12, 10), (3, 2)), ((13, 11), (3, 2)), ((9, 8, 7), (2, 3, 4)), ((5, 5), 8)])
def test_downsample_samples_the_image_at_the_coarse_centres(size, shrink):
    """A function linear in the index is reproduced exactly, also where the centres fall between fine voxels."""
    n = len(size)
    grid = Grid.create(size, (1.0, 2.0, 0.5)[:n])
    coeffs = torch.tensor([0.7, -1.3, 2.1][:n], dtype=torch.float64)
    image = (grid.index_points(torch.float64) @ coeffs)[None, None]
    out, coarse = downsample(image.repeat(2, 3, *([1] * n)), grid, shrink)
    assert out.shape == (2, 3, *coarse.shape)
    expected = grid.world_to_index(coarse.world_points(torch.float64)) @ coeffs
    torch.testing.assert_close(out[1, 2], expected)


def test_build_pyramid_smooths_then_shrinks():
    grid = Grid.create((16, 14, 12), (1.0, 1.2, 1.5), (0.0, 5.0, -3.0))
    image = torch.randn(1, 1, *grid.shape, dtype=torch.float64)
    levels = build_pyramid(image, grid, [(4, 2.0), ((2, 2, 1), (1.0, 1.0, 0.0)), (1, 0.0)])
    assert [g.size for _, g in levels] == [(4, 3, 3), (8, 7, 12), (16, 14, 12)]
    expected, _ = downsample(gaussian_smooth(image, 2.0), grid, 4)
    torch.testing.assert_close(levels[0][0], expected)
    assert torch.equal(levels[2][0], image)
    assert levels[2][1] == grid
    with pytest.raises(ValueError, match="positive integers"):
        build_pyramid(image, grid, [(1.5, 0.0)])
    with pytest.raises(ValueError, match="on the grid"):
        downsample(image[..., :5], grid, 2)
