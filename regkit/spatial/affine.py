"""Rigid and affine transformations in world coordinates, moments initialisation and export to ITK.

Conventions:

* World points are LPS millimetres in (x, y[, z]) order, shape ``(..., ndim)``.
* Pull-back: a transformation maps a point ``x`` of the FIXED image's world space to the point ``y = M x + o`` of the
  MOVING image's world space where the moving image is sampled (the direction ITK's registration transforms point).
* Homogeneous matrices are ``(ndim + 1) x (ndim + 1)``: ``[[M, o], [0, 1]]``.
* The parameterised part acts about a fixed ``centre`` ``c`` (the fixed image's centre, as ITK does):
  ``y = A (x - c) + c + t``. A module may also carry an ``initial`` homogeneous matrix ``H0`` (e.g. from
  ``moments_init`` or an earlier stage), applied after it: ``matrix() = H0 @ [[A, c + t - A c], [0, 1]]``.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch import nn

from regkit import _atomic
from regkit.errors import ImageDimensionError, ImageValueError
from regkit.spatial.grid import Grid

if TYPE_CHECKING:
    import SimpleITK as sitk

# Principal-axes sign disambiguation: a normalised third moment (skewness) below this is treated as zero (symmetric).
_SKEW_THRESHOLD = 0.1

ArrayLike = torch.Tensor | np.ndarray | list | tuple


def _as_numpy(x: ArrayLike) -> np.ndarray:
    """A float64 numpy copy of an array-like (tensors on any device included)."""
    return np.asarray(x.detach().cpu() if isinstance(x, torch.Tensor) else x, dtype=np.float64)


def grid_centre(grid: Grid) -> np.ndarray:
    """World coordinates (LPS mm) of the centre of ``grid``'s voxel-centre box, i.e. of index ``(size - 1) / 2``."""
    index = (np.asarray(grid.size, dtype=np.float64) - 1.0) / 2.0
    return grid.affine()[: grid.ndim, : grid.ndim] @ index + np.asarray(grid.origin)


def _skew(v: torch.Tensor) -> torch.Tensor:
    """Skew-symmetric generator of a rotation: 2D from ``(angle,)``, 3D from a rotation vector ``(x, y, z)``."""
    zero = v.new_zeros(())
    if v.numel() == 1:
        return torch.stack([torch.stack([zero, -v[0]]), torch.stack([v[0], zero])])
    x, y, z = v
    return torch.stack([torch.stack([zero, -z, y]), torch.stack([z, zero, -x]), torch.stack([-y, x, zero])])


class _CentredTransform(nn.Module):
    """Common part of the rigid and affine models: ``y = A (x - c) + c + t``, then the initial matrix."""

    translation: nn.Parameter
    centre: torch.Tensor
    initial: torch.Tensor

    def __init__(self, centre: ArrayLike, radius: float, initial: ArrayLike | None, dtype: torch.dtype) -> None:
        super().__init__()
        c = torch.as_tensor(_as_numpy(centre), dtype=dtype)
        n = c.numel()
        if c.dim() != 1 or n not in (2, 3):
            raise ValueError(f"centre must be a 2D or 3D world point, got shape {tuple(c.shape)}")
        if not radius > 0:
            raise ValueError(f"radius must be positive (mm), got {radius}")
        h0 = torch.eye(n + 1, dtype=dtype) if initial is None else torch.as_tensor(_as_numpy(initial), dtype=dtype)
        if h0.shape != (n + 1, n + 1):
            raise ValueError(f"initial must be a {n + 1}x{n + 1} homogeneous matrix, got shape {tuple(h0.shape)}")
        self.ndim = n
        self.radius = float(radius)
        self.register_buffer("centre", c)
        self.register_buffer("initial", h0)
        self.translation = nn.Parameter(torch.zeros(n, dtype=dtype))

    def linear(self) -> torch.Tensor:
        """The ``ndim x ndim`` linear part ``A`` of the parameterised transform (before ``initial``)."""
        raise NotImplementedError

    def matrix(self) -> torch.Tensor:
        """Homogeneous ``(ndim + 1) x (ndim + 1)`` matrix mapping fixed world points to moving world points."""
        a = self.linear()
        offset = self.centre + self.translation - a @ self.centre
        top = torch.cat([a, offset.unsqueeze(1)], dim=1)
        bottom = torch.eye(self.ndim + 1, dtype=a.dtype, device=a.device)[-1:]  # no host value: capture-safe
        return self.initial @ torch.cat([top, bottom], dim=0)

    def transform_points(self, world: torch.Tensor) -> torch.Tensor:
        """Map fixed-space world points ``(..., ndim)`` (LPS mm) to moving-space world points ``(..., ndim)``."""
        if world.shape[-1] != self.ndim:
            raise ValueError(f"expected points (..., {self.ndim}), got shape {tuple(world.shape)}")
        h = self.matrix().to(world.dtype)
        return world @ h[: self.ndim, : self.ndim].T + h[: self.ndim, self.ndim]

    def forward(self, world: torch.Tensor) -> torch.Tensor:
        """Same as ``transform_points``."""
        return self.transform_points(world)


class RigidTransform(_CentredTransform):
    """Rotation about ``centre`` plus translation, in world coordinates (see the module docstring).

    Parameters (zero = identity):
        ``rotation``: 2D ``(1,)`` angle, 3D ``(3,)`` rotation vector (axis times angle, the exponential map: smooth and
        well conditioned near the identity), both stored multiplied by ``radius`` mm, i.e. as the arc length moved by a
        point at distance ``radius`` from the centre;
        ``translation``: ``(ndim,)`` mm.

    Args:
        centre: rotation centre, a world point (LPS mm), usually ``grid_centre(fixed_grid)``.
        radius: length scale (mm) of the rotation parameters; about half the fixed image's extent makes one optimiser
            step size (in mm) fit every parameter.
        initial: optional homogeneous matrix applied after this transform (see the module docstring).
        dtype: dtype of parameters and buffers.
    """

    def __init__(
        self,
        centre: ArrayLike,
        radius: float = 1.0,
        initial: ArrayLike | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(centre, radius, initial, dtype)
        self.rotation = nn.Parameter(torch.zeros(1 if self.ndim == 2 else 3, dtype=dtype))

    def linear(self) -> torch.Tensor:
        """Rotation matrix ``expm(skew(rotation / radius))``."""
        return torch.linalg.matrix_exp(_skew(self.rotation / self.radius))


class AffineTransform(_CentredTransform):
    """General affine map about ``centre``: ``y = (I + linear / radius) (x - c) + c + translation``.

    Parameters (zero = identity): ``linear`` ``(ndim, ndim)`` stored multiplied by ``radius`` mm (the displacement of a
    point at distance ``radius`` from the centre), ``translation`` ``(ndim,)`` mm. Arguments as for ``RigidTransform``.
    """

    def __init__(
        self,
        centre: ArrayLike,
        radius: float = 1.0,
        initial: ArrayLike | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(centre, radius, initial, dtype)
        self.linear_params = nn.Parameter(torch.zeros(self.ndim, self.ndim, dtype=dtype))

    def linear(self) -> torch.Tensor:
        """``I + linear_params / radius``."""
        eye = torch.eye(self.ndim, dtype=self.linear_params.dtype, device=self.linear_params.device)
        return eye + self.linear_params / self.radius


class _Moments:
    """Intensity moments of an image in world coordinates; mass = intensity minus its minimum."""

    def __init__(self, image: torch.Tensor, grid: Grid, name: str) -> None:
        if image.numel() != int(np.prod(grid.size)):
            raise ValueError(f"{name} image has {image.numel()} voxels but its grid has shape {grid.shape}")
        values = image.detach().to(torch.float64).reshape(grid.shape)
        if not bool(torch.isfinite(values).all()):
            raise ImageValueError(f"the {name} image holds NaN or Inf values; moments initialisation needs finite ones")
        self.mass = values - values.min()
        self.total = float(self.mass.sum())
        if self.total <= 0:
            raise ImageValueError(f"the {name} image is constant; moments initialisation needs some contrast")
        n = grid.ndim
        self.linear = grid.affine()[:n, :n]
        # centred index coordinates, index axis k (0 = x) broadcast along tensor dimension n - 1 - k
        self.coords = []
        mean_index = np.zeros(n)
        for k in range(n):
            shape = [1] * n
            shape[n - 1 - k] = grid.size[k]
            axis = torch.arange(grid.size[k], dtype=torch.float64, device=values.device).view(shape)
            mean_index[k] = float((self.mass * axis).sum()) / self.total
            self.coords.append(axis - mean_index[k])
        cov_index = np.array(
            [
                [float((self.mass * self.coords[k] * self.coords[m]).sum()) / self.total for m in range(n)]
                for k in range(n)
            ]
        )
        self.centre = self.linear @ mean_index + np.asarray(grid.origin)
        self.covariance = self.linear @ cov_index @ self.linear.T

    def skewness(self, direction: np.ndarray) -> float:
        """Normalised third central moment of the mass along the world direction ``direction`` (a unit vector)."""
        u = self.linear.T @ direction  # (x - centre) . direction == (index - mean_index) . u
        proj = sum(float(u[k]) * self.coords[k] for k in range(len(u)))
        var = float(direction @ self.covariance @ direction)
        return float((self.mass * proj**3).sum()) / self.total / max(var, 1e-300) ** 1.5


def moments_init(
    fixed: torch.Tensor,
    fixed_grid: Grid,
    moving: torch.Tensor,
    moving_grid: Grid,
    mode: Literal["com", "principal_axes"] = "com",
) -> torch.Tensor:
    """Initial pull-back transformation from intensity moments, as a float64 homogeneous ``(ndim+1) x (ndim+1)`` matrix.

    Images are tensors with the voxels of their grid (``grid.shape``, optionally with leading unit axes); the mass of a
    voxel is its intensity minus the image minimum. World coordinates are LPS mm.

    * ``"com"``: translation by ``com_moving - com_fixed`` (centres of mass), no rotation.
    * ``"principal_axes"``: additionally the rotation taking the fixed image's principal axes (eigenvectors of the
      second central moments, paired by eigenvalue order) onto the moving image's, about the fixed centre of mass:
      ``y = R (x - com_fixed) + com_moving``. Each axis' sign is chosen so that the third moment (skewness) along it is
      positive in both images; for axes where either image is (nearly) symmetric the signs giving the smallest rotation
      are used. ``R`` is always a proper rotation (det +1).
    """
    if fixed_grid.ndim != moving_grid.ndim:
        raise ImageDimensionError(f"fixed image is {fixed_grid.ndim}D but moving image is {moving_grid.ndim}D")
    if mode not in ("com", "principal_axes"):
        raise ValueError(f"mode must be 'com' or 'principal_axes', got {mode!r}")
    n = fixed_grid.ndim
    mf = _Moments(fixed, fixed_grid, "fixed")
    mm = _Moments(moving, moving_grid, "moving")
    rotation = np.eye(n)
    if mode == "principal_axes":
        rotation = _principal_rotation(mf, mm)
    h = np.eye(n + 1)
    h[:n, :n] = rotation
    h[:n, n] = mm.centre - rotation @ mf.centre
    return torch.from_numpy(h)


def _principal_rotation(mf: _Moments, mm: _Moments) -> np.ndarray:
    """Proper rotation mapping the fixed principal axes onto the moving ones (see ``moments_init``)."""
    n = mf.covariance.shape[0]
    axes = []
    skews = []
    for moments in (mf, mm):
        _, vectors = np.linalg.eigh(moments.covariance)
        skew = np.array([moments.skewness(vectors[:, k]) for k in range(n)])
        vectors = vectors * np.where(skew < 0, -1.0, 1.0)
        axes.append(vectors)
        skews.append(np.abs(skew))
    confidence = np.minimum(skews[0], skews[1])
    confidence[confidence < _SKEW_THRESHOLD] = 0.0
    best_key: tuple[float, float] | None = None
    best = np.eye(n)
    for signs in itertools.product((1.0, -1.0), repeat=n):
        rotation = axes[1] @ np.diag(signs) @ axes[0].T
        if np.linalg.det(rotation) <= 0:
            continue
        key = (float(np.dot(signs, confidence)), float(np.trace(rotation)))
        if best_key is None or key > best_key:
            best_key, best = key, rotation
    return best


def _split(matrix: ArrayLike, centre: ArrayLike | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    h = _as_numpy(matrix)
    n = h.shape[0] - 1
    if h.shape != (n + 1, n + 1) or n not in (2, 3):
        raise ValueError(f"expected a 3x3 or 4x4 homogeneous matrix, got shape {h.shape}")
    c = np.zeros(n) if centre is None else _as_numpy(centre).reshape(n)
    m = h[:n, :n]
    translation = h[:n, n] - c + m @ c
    return m, translation, c


def to_itk_affine(matrix: ArrayLike, centre: ArrayLike | None = None) -> tuple[list[float], list[float]]:
    """ITK ``AffineTransform_double_N_N`` parameters of a homogeneous pull-back matrix (fixed world -> moving world).

    ITK's MatrixOffsetTransformBase maps ``y = M (x - c) + c + T``; its parameters are ``M`` row-major followed by
    ``T`` (9 + 3 in 3D, 4 + 2 in 2D) and its fixed parameters the centre ``c`` (default the origin; any centre gives
    the same map). Both spaces are LPS mm, as in ITK, so no axis flips are involved.
    """
    m, translation, c = _split(matrix, centre)
    return [*m.ravel().tolist(), *translation.tolist()], c.tolist()


def to_sitk_affine(matrix: ArrayLike, centre: ArrayLike | None = None) -> sitk.AffineTransform:
    """A ``SimpleITK.AffineTransform`` mapping points as the homogeneous ``matrix`` does (see ``to_itk_affine``)."""
    import SimpleITK as sitk

    m, translation, c = _split(matrix, centre)
    transform = sitk.AffineTransform(m.shape[0])
    transform.SetMatrix(m.ravel().tolist())
    transform.SetTranslation(translation.tolist())
    transform.SetCenter(c.tolist())
    return transform


def write_itk_affine(path: str | os.PathLike[str], matrix: ArrayLike, centre: ArrayLike | None = None) -> Path:
    """Write ``matrix`` as an ITK affine transform file (``.mat``, ``.tfm``, ``.txt`` or ``.h5``, chosen by suffix).

    ITK and ANTs read the result (e.g. ``antsApplyTransforms -t affine.mat``). The file is written to a temporary
    name in the same folder and renamed, so it is never seen half-written.
    """
    import SimpleITK as sitk

    path = Path(path)
    with _atomic.replacing(path) as tmp:
        sitk.WriteTransform(to_sitk_affine(matrix, centre), str(tmp))
    return path
