"""Evaluation metrics: Jacobian determinant, folds, SDlogJ (Learn2Reg definitions), Dice, HD95."""

import math

import numpy as np
import pytest
import torch
from scipy import ndimage

from regkit.errors import ImageValueError
from regkit.spatial.filters import gaussian_smooth
from regkit.spatial.grid import Grid
from regkit.spatial.metrics import (
    dice_per_label,
    fraction_nonpositive,
    hd95_per_label,
    jacobian_determinant,
    mean_dice,
    sdlogj,
)

OBLIQUE = np.array([[0.0, -1.0, 0.0], [0.8, 0.0, 0.6], [-0.6, 0.0, 0.8]])


def learn2reg_jacobian(disp):
    """Learn2Reg's evaluation formula, written out: disp (3, X, Y, Z) in voxels, array axes = components' axes."""
    kernel = np.array([-0.5, 0.0, 0.5])
    grads = []
    for axis in range(3):
        shape = [1, 1, 1]
        shape[axis] = 3
        grads.append(np.stack([ndimage.correlate(disp[c], kernel.reshape(shape), mode="constant") for c in range(3)]))
    jac = np.stack(grads) + np.eye(3).reshape(3, 3, 1, 1, 1)  # jac[axis, component]
    return np.linalg.det(jac.transpose(2, 3, 4, 0, 1))[2:-2, 2:-2, 2:-2]


def smooth_field(shape, ndim, amplitude, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(1, ndim, *shape, generator=g, dtype=torch.float64)
    return (amplitude * gaussian_smooth(u, 2.0))[0].movedim(0, -1)  # (*shape, ndim)


@pytest.mark.parametrize("ndim", [2, 3])
def test_linear_displacements_have_the_matrix_determinant_everywhere(ndim):
    """u(x) = (B - I) x in world mm on an anisotropic oblique grid: det = det(B), borders included."""
    b = np.eye(ndim) + np.random.default_rng(0).normal(size=(ndim, ndim)) * 0.2
    direction = OBLIQUE if ndim == 3 else [[0.6, -0.8], [0.8, 0.6]]
    grid = Grid.create((9, 8, 7)[:ndim], (0.8, 1.3, 2.0)[:ndim], (5.0, -3.0, 2.0)[:ndim], direction)
    x = grid.world_points(torch.float64)
    u = x @ torch.from_numpy(b - np.eye(ndim)).T
    det = jacobian_determinant(u, grid)
    assert det.shape == grid.shape
    torch.testing.assert_close(det, torch.full(grid.shape, np.linalg.det(b), dtype=torch.float64))
    torch.testing.assert_close(jacobian_determinant(torch.zeros_like(u)), torch.ones(grid.shape, dtype=torch.float64))


def test_jacobian_equals_learn2reg_in_the_interior():
    disp = smooth_field((12, 13, 14), 3, 4.0, 1)  # [z, y, x] layout, components (i, j, k) in voxels
    ours = jacobian_determinant(disp)[2:-2, 2:-2, 2:-2]
    # Learn2Reg arrays are (component, X, Y, Z): reverse our tensor axes; component c moves along axis c
    l2r = learn2reg_jacobian(disp.permute(3, 2, 1, 0).numpy())
    np.testing.assert_allclose(ours.permute(2, 1, 0).numpy(), l2r, atol=1e-12)
    # in world mm on an anisotropic oblique grid the determinant is unchanged
    grid = Grid.create((14, 13, 12), (0.7, 1.1, 2.3), (1.0, 2.0, 3.0), OBLIQUE)
    world = disp @ torch.from_numpy(grid.affine()[:3, :3]).T
    torch.testing.assert_close(jacobian_determinant(world, grid), jacobian_determinant(disp))


def test_a_folding_field_has_negative_determinants():
    """u_x = a sin(2 pi x / L) with a 2 pi / L = 2: det = 1 + 2 cos(2 pi x / L) < 0 on a third of each period."""
    length, amplitude = 16.0, 2.0 * 16.0 / (2 * math.pi)
    grid = Grid.create((32, 20))
    x = grid.world_points(torch.float64)
    u = torch.stack([amplitude * torch.sin(2 * math.pi * x[..., 0] / length), torch.zeros_like(x[..., 0])], -1)
    det = jacobian_determinant(u, grid)
    assert float(det.min()) < -0.5
    inner = det[2:-2, 2:-2]
    assert fraction_nonpositive(det) == pytest.approx(float((inner <= 0).double().mean()))
    assert 0.2 < fraction_nonpositive(det) < 0.5
    mask = torch.zeros(grid.shape)
    mask[:, 8] = 1  # x = 8, the middle of a fold: det = 1 - a sin(pi / 8) ~ -0.95 with central differences
    assert fraction_nonpositive(det, mask) == 1.0


def test_sdlogj_uses_the_learn2reg_definition():
    det = 1.0 + 0.3 * torch.randn(10, 11, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    det[5, 5, 5] = -3.5  # det + 3 < 0: clipped to 1e-9
    inner = det.numpy()[2:-2, 2:-2, 2:-2]
    expected = np.log(np.clip(inner + 3, 1e-9, 1e9)).std()
    assert sdlogj(det) == pytest.approx(expected, rel=1e-12)
    mask = (torch.rand(det.shape, generator=torch.Generator().manual_seed(1)) > 0.5).float()
    masked = np.ma.MaskedArray(np.log(np.clip(inner + 3, 1e-9, 1e9)), 1 - mask.numpy()[2:-2, 2:-2, 2:-2]).std()
    assert sdlogj(det, mask) == pytest.approx(float(masked), rel=1e-12)
    assert sdlogj(torch.ones(8, 8, 8)) == 0.0
    assert sdlogj(det.abs() + 0.1, offset=0.0) == pytest.approx(np.log(np.abs(inner) + 0.1).std(), rel=1e-12)
    with pytest.raises(ImageValueError, match="empty"):
        sdlogj(det, torch.zeros(det.shape))
    with pytest.raises(ValueError, match="crop"):
        sdlogj(torch.ones(4, 8, 8))


def test_dice_hand_computed():
    a = torch.tensor([[1, 1, 2, 0], [3, 3, 3, 0]])
    b = torch.tensor([[1, 0, 2, 2], [0, 3, 3, 3]])
    dice = dice_per_label(a, b)
    assert dice == pytest.approx({1: 2 / 3, 2: 2 / 3, 3: 2 * 2 / 6})
    assert mean_dice(a, b) == pytest.approx((2 / 3 + 2 / 3 + 2 / 3) / 3)
    with_absent = dice_per_label(a, b, labels=[0, 1, 7])
    assert list(with_absent) == [1, 7] and math.isnan(with_absent[7])
    assert mean_dice(a, b, labels=[1, 7]) == pytest.approx(2 / 3)
    labels = torch.randint(0, 6, (7, 8, 9))
    assert all(v == 1.0 for v in dice_per_label(labels, labels.clone()).values())
    assert mean_dice(labels.numpy(), labels.numpy()) == 1.0
    with pytest.raises(ImageValueError, match="integers"):
        dice_per_label(labels.float(), labels)


@pytest.mark.parametrize("axis, shift", [(2, 3), (0, 2), (1, 4)])
def test_hd95_of_a_shifted_cube_is_the_shift(axis, shift):
    spacing = (2.0, 1.0, 1.5)  # index order x, y, z
    a = torch.zeros(24, 26, 28, dtype=torch.int64)
    a[6:16, 6:16, 6:16] = 5
    b = torch.roll(a, shift, dims=axis)
    mm = shift * spacing[2 - axis]
    assert hd95_per_label(a, b, spacing) == {5: pytest.approx(mm)}
    assert hd95_per_label(a, a, spacing) == {5: 0.0}
    missing = hd95_per_label(a, torch.zeros_like(a), spacing)
    assert math.isnan(missing[5])


def test_hd95_two_labels_2d_and_errors():
    a = torch.zeros(30, 30, dtype=torch.int32)
    a[5:12, 5:12] = 1
    a[15:25, 15:25] = 2
    b = torch.zeros_like(a)
    b[5:12, 7:14] = 1  # label 1 moved 2 voxels along x (spacing 0.5 mm), label 2 unmoved
    b[15:25, 15:25] = 2
    result = hd95_per_label(a, b, (0.5, 1.0))
    assert result == {1: pytest.approx(1.0), 2: 0.0}
    with pytest.raises(ValueError, match="spacing"):
        hd95_per_label(a, b, (1.0, 1.0, 1.0))
