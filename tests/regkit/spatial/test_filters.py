"""Separable filters: box sums against pooling, Gaussian smoothing against scipy, gradients."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import ndimage

from regkit.spatial.filters import box_sum, gaussian_smooth


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize(
    "shape, window",
    [
        ((2, 3, 9, 11), 5),
        ((1, 2, 7, 8, 9), (3, 5, 7)),
        ((1, 1, 4, 5), 9),
        ((1, 2, 6, 40, 30), (1, 3, 5)),  # z lines in more than one bundle (numba), a window of one voxel along x
    ],
)
def test_box_sum_matches_zero_padded_pooling(shape, window, backend):
    x = torch.randn(*shape, dtype=torch.float64)
    ndim = len(shape) - 2
    sizes = (window,) * ndim if isinstance(window, int) else window
    kernel = tuple(reversed(sizes))  # tensor axis order
    pool = F.avg_pool2d if ndim == 2 else F.avg_pool3d
    padded = F.pad(x, [p for k in sizes for p in (k // 2, k // 2)])  # F.pad lists the last tensor axis (x) first
    expected = pool(padded, kernel, stride=1) * float(np.prod(kernel))
    torch.testing.assert_close(box_sum(x, window, backend), expected)
    torch.testing.assert_close(box_sum(x.float(), window, backend), expected.float())


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_box_sum_gradcheck_and_errors(backend):
    x = torch.randn(1, 2, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: box_sum(t, (3, 5), backend), (x,))
    assert torch.autograd.gradgradcheck(lambda t: box_sum(t, 3, backend), (x,))
    with pytest.raises(ValueError, match="odd"):
        box_sum(x, 4)
    with pytest.raises(ValueError, match="2 or 3 spatial"):
        box_sum(torch.zeros(5, 5), 3)


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize(
    "shape, sigma", [((12, 13, 14), 1.0), ((12, 13, 14), 0.7), ((12, 13, 14), (2.0, 0.0, 1.3)), ((3, 4, 5), 2.0)]
)
def test_gaussian_smooth_matches_scipy(shape, sigma, backend):
    """Including kernels wider than the image (replicated borders far out)."""
    x = torch.randn(1, 1, *shape, dtype=torch.float64)
    sig = (sigma,) * 3 if isinstance(sigma, float) else sigma
    expected = ndimage.gaussian_filter(x[0, 0].numpy(), sigma=sig[::-1], mode="nearest", truncate=4.0)
    np.testing.assert_allclose(gaussian_smooth(x, sigma, backend)[0, 0].numpy(), expected, atol=1e-12)
    np.testing.assert_allclose(gaussian_smooth(x.float(), sigma, backend)[0, 0].numpy(), expected, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_gaussian_smooth_keeps_constants_and_is_differentiable(backend):
    x = torch.full((2, 1, 6, 7), 3.5, dtype=torch.float64)
    torch.testing.assert_close(gaussian_smooth(x, 2.0, backend), x)
    y = torch.randn(1, 1, 5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: gaussian_smooth(t, (0.8, 1.5), backend), (y,))
    with pytest.raises(ValueError, match="non-negative"):
        gaussian_smooth(x, -1.0)
