"""Rigid and affine models, moments initialisation and the ITK export."""

import math

import numpy as np
import pytest
import SimpleITK as sitk
import torch

from regkit.errors import ImageDimensionError, ImageValueError
from regkit.spatial.affine import (
    AffineTransform,
    RigidTransform,
    grid_centre,
    moments_init,
    to_itk_affine,
    to_sitk_affine,
    write_itk_affine,
)
from regkit.spatial.grid import Grid


def rotation_matrix(axis, angle):
    """Rodrigues' rotation matrix (numpy, float64)."""
    axis = np.asarray(axis, dtype=np.float64)
    if axis.size == 1:
        c, s = math.cos(angle), math.sin(angle)
        return np.array([[c, -s], [s, c]])
    k = axis / np.linalg.norm(axis)
    kx = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
    return np.eye(3) + math.sin(angle) * kx + (1 - math.cos(angle)) * kx @ kx


def homogeneous(m, t):
    n = len(t)
    h = np.eye(n + 1)
    h[:n, :n], h[:n, n] = m, t
    return h


# --- parameterisations ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [RigidTransform, AffineTransform])
@pytest.mark.parametrize("centre", [(10.0, -4.0), (1.0, 2.0, 3.0)])
def test_zero_parameters_give_the_identity(cls, centre):
    t = cls(centre, radius=50.0)
    n = len(centre)
    torch.testing.assert_close(t.matrix(), torch.eye(n + 1))
    pts = torch.randn(7, n) * 30
    torch.testing.assert_close(t.transform_points(pts), pts)


@pytest.mark.parametrize("ndim", [2, 3])
def test_rigid_is_a_rotation_about_the_centre(ndim):
    centre = torch.arange(ndim, dtype=torch.float64) * 5 + 1
    t = RigidTransform(centre, radius=40.0, dtype=torch.float64)
    with torch.no_grad():
        t.rotation.copy_(torch.randn(t.rotation.shape, dtype=torch.float64) * 20)
        t.translation.copy_(torch.tensor([3.0, -2.0, 1.0][:ndim], dtype=torch.float64))
    r = t.matrix().detach()[:ndim, :ndim]
    torch.testing.assert_close(r @ r.T, torch.eye(ndim, dtype=torch.float64))
    assert float(torch.linalg.det(r)) == pytest.approx(1.0)
    torch.testing.assert_close(t.transform_points(centre), centre + t.translation.detach())
    rot = t.rotation.detach().numpy()
    angle = (np.linalg.norm(rot) if ndim == 3 else rot[0]) / 40.0
    np.testing.assert_allclose(r.numpy(), rotation_matrix(rot, angle), atol=1e-12)


def test_initial_matrix_is_applied_after_the_parameters():
    initial = torch.from_numpy(homogeneous(rotation_matrix([0, 0, 1], 0.3), [1.0, 2.0, 3.0]))
    t = AffineTransform((5.0, 0.0, -5.0), radius=10.0, initial=initial, dtype=torch.float64)
    with torch.no_grad():
        t.linear_params.copy_(torch.randn(3, 3, dtype=torch.float64))
        t.translation.copy_(torch.randn(3, dtype=torch.float64))
    local = AffineTransform((5.0, 0.0, -5.0), radius=10.0, dtype=torch.float64)
    local.load_state_dict({k: v for k, v in t.state_dict().items() if k != "initial"} | {"initial": torch.eye(4)})
    torch.testing.assert_close(t.matrix(), initial @ local.matrix())


@pytest.mark.parametrize("cls", [RigidTransform, AffineTransform])
def test_transform_points_gradcheck(cls):
    t = cls((1.0, -2.0, 0.5), radius=3.0, dtype=torch.float64)
    names = [n for n, _ in t.named_parameters()]
    pts = torch.randn(5, 3, dtype=torch.float64) * 4

    def mapped(*values):
        return torch.func.functional_call(t, dict(zip(names, values, strict=True)), (pts,))

    for scale in (0.3, 0.0):  # away from zero, and at zero (the exponential map's special point)
        values = tuple((scale * torch.randn(p.shape, dtype=torch.float64)).requires_grad_(True) for p in t.parameters())
        assert torch.autograd.gradcheck(mapped, values)


@pytest.mark.parametrize("ndim", [2, 3])
def test_adam_recovers_a_known_rigid_transform(ndim):
    rng = np.random.default_rng(0)
    centre = rng.normal(size=ndim) * 10
    angle = 0.4
    r_true = rotation_matrix([0.3, -0.5, 0.8] if ndim == 3 else [1.0], angle)
    t_true = np.array([4.0, -6.0, 2.5][:ndim])
    pts = torch.from_numpy(rng.uniform(-60, 60, size=(200, ndim)) + centre)
    target = (pts - torch.from_numpy(centre)) @ torch.from_numpy(r_true).T + torch.from_numpy(centre + t_true)
    model = RigidTransform(centre, radius=60.0, dtype=torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    for _ in range(300):
        opt.zero_grad()
        loss = ((model(pts) - target) ** 2).sum(-1).mean()
        loss.backward()
        opt.step()
    h = model.matrix().detach().numpy()
    np.testing.assert_allclose(h[:ndim, :ndim], r_true, atol=1e-3)
    np.testing.assert_allclose(model.translation.detach().numpy(), t_true, atol=0.05)


def test_adam_recovers_a_known_affine_transform():
    rng = np.random.default_rng(1)
    a_true = np.array([[1.1, 0.1, -0.05], [-0.08, 0.9, 0.12], [0.05, 0.02, 1.2]])
    t_true = np.array([-3.0, 5.0, 1.0])
    h_true = homogeneous(a_true, t_true)
    pts = torch.from_numpy(rng.uniform(-50, 50, size=(300, 3)))
    target = pts @ torch.from_numpy(a_true).T + torch.from_numpy(t_true)
    model = AffineTransform(np.zeros(3), radius=50.0, dtype=torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    for _ in range(400):
        opt.zero_grad()
        ((model(pts) - target) ** 2).sum(-1).mean().backward()
        opt.step()
    np.testing.assert_allclose(model.matrix().detach().numpy(), h_true, atol=2e-3)


# --- ITK export -----------------------------------------------------------------------------------------------------


def random_transform(ndim, seed):
    rng = np.random.default_rng(seed)
    m = np.eye(ndim) + 0.2 * rng.normal(size=(ndim, ndim))
    return homogeneous(m, rng.normal(size=ndim) * 10)


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("centre", [None, "random"])
def test_itk_export_maps_points_like_ours(ndim, centre):
    h = random_transform(ndim, 3)
    c = None if centre is None else np.random.default_rng(4).normal(size=ndim) * 20
    params, fixed = to_itk_affine(h, c)
    assert len(params) == ndim * ndim + ndim
    assert fixed == ([0.0] * ndim if c is None else pytest.approx(list(c)))
    tx = to_sitk_affine(torch.from_numpy(h), c)
    assert tx.GetName() == "AffineTransform"
    np.testing.assert_allclose(tx.GetParameters(), params, atol=1e-12)
    np.testing.assert_allclose(tx.GetFixedParameters(), fixed, atol=1e-12)
    model = AffineTransform(np.zeros(ndim), initial=h, dtype=torch.float64)
    pts = np.random.default_rng(5).uniform(-80, 80, size=(20, ndim))
    ours = model.transform_points(torch.from_numpy(pts)).detach().numpy()
    itk = np.array([tx.TransformPoint(tuple(p)) for p in pts])
    np.testing.assert_allclose(itk, ours, atol=1e-9)


@pytest.mark.parametrize("suffix", [".mat", ".tfm"])
def test_write_itk_affine_round_trips_through_simpleitk(tmp_path, suffix):
    model = RigidTransform((10.0, 20.0, -30.0), radius=50.0, dtype=torch.float64)
    with torch.no_grad():
        model.rotation.copy_(torch.tensor([5.0, -8.0, 12.0], dtype=torch.float64))
        model.translation.copy_(torch.tensor([1.5, -2.0, 3.0], dtype=torch.float64))
    path = write_itk_affine(tmp_path / f"affine{suffix}", model.matrix(), model.centre)
    assert path.exists() and sorted(p.name for p in tmp_path.iterdir()) == [f"affine{suffix}"]
    tx = sitk.ReadTransform(str(path))
    if suffix == ".mat":
        assert "AffineTransform_double_3_3" in path.read_bytes().decode("latin-1")
    pts = np.random.default_rng(6).uniform(-80, 80, size=(10, 3))
    ours = model.transform_points(torch.from_numpy(pts)).detach().numpy()
    np.testing.assert_allclose([tx.TransformPoint(tuple(p)) for p in pts], ours, atol=1e-6)


# --- moments initialisation -----------------------------------------------------------------------------------------


def shape_function(x, bump):
    """A soft ellipsoid (semi-axes 24, 14, 8 mm) with an optional off-centre bump that breaks its symmetry (mm, LPS)."""
    n = x.shape[-1]
    semi = torch.tensor([24.0, 14.0, 8.0][:n], dtype=x.dtype)
    r = ((x / semi) ** 2).sum(-1).sqrt()
    value = torch.sigmoid((1.0 - r) * 12.0)
    if bump:
        offset = torch.tensor([14.0, 6.0, 3.0][:n], dtype=x.dtype)
        value = value + 1.5 * torch.exp(-((x - offset) ** 2).sum(-1) / (2 * 4.0**2))
    return value


def sample_pair(ndim, h_true, bump):
    """Fixed image = shape on a fixed grid; moving image = the shape moved by ``h_true`` (fixed -> moving world)."""
    n = ndim
    fixed_grid = Grid.create((48, 44, 36)[:n], (1.5, 1.5, 1.5)[:n], (-36.0, -33.0, -27.0)[:n])
    direction = rotation_matrix([0.0, 0.0, 1.0] if n == 3 else [1.0], 0.2)
    moving_grid = Grid.create((60, 56, 40)[:n], (1.2, 1.25, 1.5)[:n], (-30.0, -40.0, -25.0)[:n], direction)
    inverse = torch.from_numpy(np.linalg.inv(h_true))
    fixed = shape_function(fixed_grid.world_points(torch.float64), bump)
    y = moving_grid.world_points(torch.float64)
    moving = shape_function(y @ inverse[:n, :n].T + inverse[:n, n], bump)
    return fixed, fixed_grid, moving, moving_grid


@pytest.mark.parametrize("ndim", [2, 3])
def test_centre_of_mass_recovers_a_translation(ndim):
    h_true = homogeneous(np.eye(ndim), np.array([6.0, -4.5, 3.0][:ndim]))
    fixed, fg, moving, mg = sample_pair(ndim, h_true, bump=True)
    h = moments_init(fixed, fg, moving, mg, mode="com")
    assert h.dtype == torch.float64
    np.testing.assert_allclose(h.numpy(), h_true, atol=0.05)


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("bump", [True, False])
def test_principal_axes_recover_a_rotation(ndim, bump):
    """With the bump the skewness fixes the axes' signs (a large rotation); without, the smallest rotation is taken."""
    angle = 2.2 if bump else 0.5
    r_true = rotation_matrix([0.2, 0.3, 1.0] if ndim == 3 else [1.0], angle)
    h_true = homogeneous(r_true, np.array([5.0, -3.0, 2.0][:ndim]))
    fixed, fg, moving, mg = sample_pair(ndim, h_true, bump)
    h = moments_init(fixed, fg, moving, mg, mode="principal_axes").numpy()
    r = h[:ndim, :ndim]
    assert np.linalg.det(r) == pytest.approx(1.0)
    error = math.degrees(math.acos(np.clip((np.trace(r.T @ r_true) - (ndim - 2)) / 2, -1, 1)))
    assert error < 2.0
    same = moments_init(fixed, fg, fixed, fg, mode="principal_axes").numpy()
    np.testing.assert_allclose(same, np.eye(ndim + 1), atol=1e-9)
    points = torch.randn(50, ndim, dtype=torch.float64).numpy() * 10
    mapped = points @ r.T + h[:ndim, ndim]
    np.testing.assert_allclose(mapped, points @ r_true.T + h_true[:ndim, ndim], atol=0.6)


def test_moments_init_errors():
    g = Grid.create((8, 9))
    img = torch.rand(9, 8, dtype=torch.float64)
    with pytest.raises(ImageValueError, match="constant"):
        moments_init(torch.ones(9, 8), g, img, g)
    with pytest.raises(ImageDimensionError, match="3D"):
        moments_init(img, g, torch.rand(4, 4, 4), Grid.create((4, 4, 4)))
    assert grid_centre(g) == pytest.approx([3.5, 4.0])


def test_simpleitk_resampling_with_the_export_matches_our_pull_back():
    """sitk.Resample maps output (fixed) points through the transform into the input (moving): our convention."""
    from regkit.spatial.sampling import sample_image

    fixed_grid = Grid.create((20, 18), (1.5, 2.0), (-10.0, 4.0), [[0.8, -0.6], [0.6, 0.8]])
    moving_grid = Grid.create((50, 45), (1.2, 1.4), (-40.0, -5.0))
    moving = torch.rand(moving_grid.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    model = RigidTransform(grid_centre(fixed_grid), radius=20.0, dtype=torch.float64)
    with torch.no_grad():
        model.rotation.fill_(4.0)
        model.translation.copy_(torch.tensor([2.0, -1.5], dtype=torch.float64))
    ours = sample_image(moving, moving_grid, model(fixed_grid.world_points(torch.float64))).detach()
    moving_img = sitk.GetImageFromArray(moving.numpy())
    moving_img.SetSpacing(moving_grid.spacing)
    moving_img.SetOrigin(moving_grid.origin)
    reference = sitk.Image(list(fixed_grid.size), sitk.sitkFloat64)
    reference.SetSpacing(fixed_grid.spacing)
    reference.SetOrigin(fixed_grid.origin)
    reference.SetDirection(np.asarray(fixed_grid.direction).ravel().tolist())
    tx = to_sitk_affine(model.matrix(), model.centre)
    theirs = sitk.GetArrayFromImage(sitk.Resample(moving_img, reference, tx, sitk.sitkLinear, 0.0))
    inside = (theirs != 0).sum()
    assert inside > 0.8 * theirs.size
    np.testing.assert_allclose(ours.numpy()[theirs != 0], theirs[theirs != 0], atol=1e-9)
