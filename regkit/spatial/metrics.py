"""Evaluation metrics of a registration, with the Learn2Reg definitions.

* Jacobian determinant of a pull-back displacement field (``x -> x + u(x)``) by central differences, and from it the
  fraction of non-positive determinants and SDlogJ, both on the interior that Learn2Reg's evaluation keeps.
* Dice per label and its mean, and HD95, for integer label maps on one grid (background 0 excluded).

Learn2Reg's evaluation (``evaluation/utils.py`` and ``evaluation.py`` of the L2R repository) computes the Jacobian of
a displacement in voxel units with the kernel ``[-0.5, 0, 0.5]`` (central differences) along each array axis, keeps
the interior ``[2:-2]`` of every axis, and reports ``std(log(clip(det + 3, 1e-9, 1e9)))`` (population std, over the
fixed mask when one is given); the ``+ 3`` is part of their definition. Label maps are ``[z, y, x]`` (or ``[y, x]``)
tensors; spacings are in index order (x, y[, z]), mm.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from regkit.errors import ImageValueError
from regkit.spatial.grid import Grid

# Learn2Reg's SDlogJ: log(clip(det + offset, 1e-9, 1e9)) over the interior [crop:-crop].
L2R_CROP = 2
L2R_LOG_OFFSET = 3.0
_L2R_CLIP = (1e-9, 1e9)


def jacobian_determinant(displacement: torch.Tensor, grid: Grid | None = None) -> torch.Tensor:
    """Determinant of the Jacobian of ``x -> x + u(x)`` at every voxel, shape ``displacement.shape[:-1]``.

    Args:
        displacement: ``(*spatial, ndim)`` with spatial layout ``[z, y, x]`` (or ``[y, x]``). With ``grid``: ITK
            convention, components (x, y[, z]) in LPS mm on ``grid``; without: components (i, j[, k]) in voxel units.
        grid: the fixed grid the displacement lives on (``grid.shape == spatial``), or None for voxel units.

    Derivatives are central differences in voxel units (one-sided on the outermost voxels); a world-mm displacement is
    first converted to voxel units with the grid's spacing and direction. The determinant does not depend on that
    choice: with ``x = A i``, ``I + du/dx = A (I + dd/di) A^-1`` holds exactly for the discrete differences too, so
    this is also the determinant in world mm. In the interior it equals Learn2Reg's ``jacobian_determinant``.
    """
    n = displacement.shape[-1]
    if n not in (2, 3) or displacement.dim() != n + 1:
        raise ValueError(f"expected a displacement (*spatial, ndim) with ndim 2 or 3, got {tuple(displacement.shape)}")
    if min(displacement.shape[:-1]) < 2:
        raise ValueError(f"the displacement needs at least 2 voxels along every axis, got {tuple(displacement.shape)}")
    if grid is not None:
        if grid.shape != tuple(displacement.shape[:-1]):
            raise ValueError(f"displacement shape {tuple(displacement.shape)} does not match grid shape {grid.shape}")
        to_index = torch.as_tensor(np.linalg.inv(grid.affine()[:n, :n]), dtype=displacement.dtype)
        displacement = displacement @ to_index.to(displacement.device).T
    # jac[..., r, c] = d(component r) / d(index axis c); index axis c is tensor dim n - 1 - c
    grads = torch.gradient(displacement, dim=tuple(range(n)))
    jac = torch.stack([grads[n - 1 - c] for c in range(n)], dim=-1)
    jac = jac + torch.eye(n, dtype=jac.dtype, device=jac.device)
    if n == 2:
        return jac[..., 0, 0] * jac[..., 1, 1] - jac[..., 0, 1] * jac[..., 1, 0]
    return (
        jac[..., 0, 0] * (jac[..., 1, 1] * jac[..., 2, 2] - jac[..., 1, 2] * jac[..., 2, 1])
        - jac[..., 0, 1] * (jac[..., 1, 0] * jac[..., 2, 2] - jac[..., 1, 2] * jac[..., 2, 0])
        + jac[..., 0, 2] * (jac[..., 1, 0] * jac[..., 2, 1] - jac[..., 1, 1] * jac[..., 2, 0])
    )


def _interior(det: torch.Tensor, mask: torch.Tensor | None, crop: int) -> torch.Tensor:
    """Determinant values in the interior ``[crop:-crop]`` of every axis where ``mask`` (same shape) is non-zero."""
    if mask is not None and tuple(mask.shape) != tuple(det.shape):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match determinant shape {tuple(det.shape)}")
    if crop < 0 or any(s <= 2 * crop for s in det.shape):
        raise ValueError(f"cannot crop {crop} voxels from each side of shape {tuple(det.shape)}")
    window = tuple(slice(crop, s - crop) for s in det.shape)
    values = det[window]
    if mask is None:
        return values.reshape(-1)
    selected = values[mask[window] != 0]
    if selected.numel() == 0:
        raise ImageValueError("the evaluation mask is empty inside the Jacobian's interior")
    return selected


def fraction_nonpositive(det: torch.Tensor, mask: torch.Tensor | None = None, crop: int = L2R_CROP) -> float:
    """Fraction of voxels with ``det <= 0`` (folds) in the interior ``[crop:-crop]``, within ``mask`` if given."""
    values = _interior(det, mask, crop)
    return float((values <= 0).double().mean())


def sdlogj(
    det: torch.Tensor,
    mask: torch.Tensor | None = None,
    crop: int = L2R_CROP,
    offset: float = L2R_LOG_OFFSET,
) -> float:
    """SDlogJ with the Learn2Reg definition: ``std(log(clip(det + offset, 1e-9, 1e9)))``.

    Population standard deviation over the interior ``[crop:-crop]`` of every axis, within ``mask`` (non-zero voxels)
    if given. Learn2Reg uses ``offset = 3`` and ``crop = 2``; ``offset = 0`` gives the textbook std of log det (folded
    voxels then enter as log 1e-9).
    """
    values = _interior(det, mask, crop).double()
    return float(torch.log((values + offset).clamp(*_L2R_CLIP)).std(unbiased=False))


def _labels(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    ta, tb = torch.as_tensor(a), torch.as_tensor(b)
    for name, t in (("first", ta), ("second", tb)):
        if t.is_floating_point() or t.is_complex():
            raise ImageValueError(f"the {name} label map has dtype {t.dtype}; label maps must hold integers")
    if ta.shape != tb.shape:
        raise ValueError(f"label maps differ in shape: {tuple(ta.shape)} and {tuple(tb.shape)}")
    return ta, tb.to(ta.device)


def _label_list(ta: torch.Tensor, tb: torch.Tensor, labels: Iterable[int] | None) -> list[int]:
    if labels is not None:
        return [int(v) for v in labels if int(v) != 0]
    return [int(v) for v in torch.unique(torch.cat([torch.unique(ta), torch.unique(tb)])) if int(v) != 0]


def dice_per_label(
    a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray, labels: Iterable[int] | None = None
) -> dict[int, float]:
    """Dice ``2 |A n B| / (|A| + |B|)`` of every label of two integer label maps on one grid.

    ``labels`` defaults to every label present in either map; 0 (background) is always excluded. A label absent from
    both maps gets NaN.
    """
    ta, tb = _labels(a, b)
    wanted = _label_list(ta, tb, labels)
    va, ca = torch.unique(ta, return_counts=True)
    vb, cb = torch.unique(tb, return_counts=True)
    vi, ci = torch.unique(ta[ta == tb], return_counts=True)
    count_a = dict(zip(va.tolist(), ca.tolist(), strict=True))
    count_b = dict(zip(vb.tolist(), cb.tolist(), strict=True))
    count_i = dict(zip(vi.tolist(), ci.tolist(), strict=True))
    result = {}
    for label in wanted:
        total = count_a.get(label, 0) + count_b.get(label, 0)
        result[label] = 2.0 * count_i.get(label, 0) / total if total else float("nan")
    return result


def mean_dice(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray, labels: Iterable[int] | None = None) -> float:
    """Mean of ``dice_per_label`` over the labels, ignoring NaN (labels absent from both maps)."""
    values = np.array(list(dice_per_label(a, b, labels).values()), dtype=np.float64)
    if values.size == 0 or np.all(np.isnan(values)):
        return float("nan")
    return float(np.nanmean(values))


def hd95_per_label(
    a: torch.Tensor | np.ndarray,
    b: torch.Tensor | np.ndarray,
    spacing: Sequence[float],
    labels: Iterable[int] | None = None,
) -> dict[int, float]:
    """95th-percentile symmetric Hausdorff distance (mm) between the surfaces of each label of two label maps.

    Surface voxels are label voxels with a face neighbour outside the label (or on the image border). For each label,
    the distances (with the grid ``spacing``, index order x, y[, z], mm) from every surface voxel of one map to the
    nearest surface voxel of the other are computed with scipy's Euclidean distance transform, in both directions; the
    result is the larger of the two directed 95th percentiles. A label missing from either map gets NaN.
    """
    from scipy import ndimage

    ta, tb = _labels(a, b)
    if len(spacing) != ta.dim():
        raise ValueError(f"spacing {tuple(spacing)} does not match label maps of shape {tuple(ta.shape)}")
    sampling = tuple(float(s) for s in reversed(spacing))
    na, nb = ta.cpu().numpy(), tb.cpu().numpy()
    structure = ndimage.generate_binary_structure(na.ndim, 1)
    result = {}
    for label in _label_list(ta, tb, labels):
        ma, mb = na == label, nb == label
        if not ma.any() or not mb.any():
            result[label] = float("nan")
            continue
        # Crop to the union's bounding box: every surface voxel, and so every nearest one, lies inside it.
        box = ndimage.find_objects((ma | mb).astype(np.int8))[0]
        sa = ma[box] & ~ndimage.binary_erosion(ma[box], structure, border_value=0)
        sb = mb[box] & ~ndimage.binary_erosion(mb[box], structure, border_value=0)
        to_b = ndimage.distance_transform_edt(~sb, sampling=sampling)[sa]
        to_a = ndimage.distance_transform_edt(~sa, sampling=sampling)[sb]
        result[label] = float(max(np.percentile(to_b, 95), np.percentile(to_a, 95)))
    return result
