"""The quality-control picture ``qc.png``: checkerboard, deformed grid and Jacobian map of a registration.

Arrays are on the fixed grid: ``[z, y, x]`` (or ``[y, x]``) tensors, the displacement ``(*grid.shape, n)`` in LPS
millimetres (pull-back, ``x_moving = x + u(x)``). Panels keep the physical aspect ratio; 3D slices show k pointing up.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from regkit.spatial.grid import Grid

__all__ = ["QC_SIDE", "qc_picture"]

_PERCENTILES = (0.5, 99.5)  # display window of the QC picture
QC_SIDE = 256  # longest side of a QC panel, pixels
_QC_GAP = 4  # black pixels between QC panels


def _window(values: np.ndarray) -> np.ndarray:
    """Values mapped to [0, 1] between their 0.5th and 99.5th percentiles (clipped)."""
    lo, hi = np.percentile(values, _PERCENTILES)
    return np.zeros_like(values) if hi <= lo else np.clip((values - lo) / (hi - lo), 0.0, 1.0)


def _jacobian_colours(det: np.ndarray, folded: np.ndarray) -> np.ndarray:
    """RGB in [0, 1]: from blue (det <= 1/sqrt 2, shrinking) through white (det = 1) to red (det >= sqrt 2, growing),
    linear in log2(det); ``folded`` pixels green."""
    t = np.clip(2.0 * np.log2(np.maximum(det, 1e-6)), -1.0, 1.0)[..., None]
    white = np.ones(3)
    rgb = np.where(
        t < 0, white + (-t) * (np.array([0.1, 0.25, 0.9]) - white), white + t * (np.array([0.9, 0.1, 0.1]) - white)
    )
    rgb[folded] = (0.0, 1.0, 0.0)
    return rgb


def _slices(shape: tuple[int, ...]) -> list[tuple[tuple, tuple[int, int], bool]]:
    """(tensor index, (row index axis, column index axis), flip rows) of the QC slices: the whole 2D image, or the
    3D mid-slices: axial (k fixed), coronal (j fixed) and sagittal (i fixed), k pointing up."""
    if len(shape) == 2:
        return [((slice(None), slice(None)), (1, 0), False)]
    z, y, x = (s // 2 for s in shape)
    return [
        ((z, slice(None), slice(None)), (1, 0), False),
        ((slice(None), y, slice(None)), (2, 0), True),
        ((slice(None), slice(None), x), (2, 1), True),
    ]


def qc_picture(
    fixed: torch.Tensor,
    warped: torch.Tensor,
    displacement: torch.Tensor,
    det: torch.Tensor,
    folded: torch.Tensor,
    grid: Grid,
) -> np.ndarray:
    """The QC picture as an RGB uint8 array ``(H, W, 3)``: one row per slice (the 2D image, or the three orthogonal
    3D mid-slices), each with a fixed/warped checkerboard, the warped image under the deformed grid (lines of
    constant fixed index of ``x + u(x)``, in yellow) and the Jacobian determinant map (:func:`_jacobian_colours`;
    ``folded`` voxels green). Arrays are on ``grid`` (``grid.shape``, ``displacement`` ``(*grid.shape, n)``); panels
    keep the physical aspect ratio, the longest side :data:`QC_SIDE` pixels."""
    fixed_w = torch.from_numpy(_window(fixed.float().numpy()))
    warped_w = torch.from_numpy(_window(warped.float().numpy()))
    n = grid.ndim
    to_index = torch.as_tensor(np.linalg.inv(grid.affine()[:n, :n]).T, dtype=torch.float32)
    rows = []
    for index, (row_axis, col_axis), flip in _slices(grid.shape):
        shift = displacement[index].float() @ to_index  # the displacement in index units of the fixed grid
        n_rows, n_cols = shift.shape[:2]
        c_row = torch.arange(n_rows, dtype=torch.float32)[:, None] + shift[..., row_axis]
        c_col = torch.arange(n_cols, dtype=torch.float32)[None, :] + shift[..., col_axis]
        planes = torch.stack([fixed_w[index], warped_w[index], c_row, c_col, det[index].float()])
        mask = folded[index].float()
        if flip:
            planes, mask = planes.flip(-2), mask.flip(-2)
        height_mm, width_mm = n_rows * grid.spacing[row_axis], n_cols * grid.spacing[col_axis]
        scale = QC_SIDE / max(height_mm, width_mm)
        size = (max(1, round(height_mm * scale)), max(1, round(width_mm * scale)))
        f, w, c_row, c_col, d = F.interpolate(planes[None], size=size, mode="bilinear", align_corners=False)[0].numpy()
        folds = F.interpolate(mask[None, None], size=size, mode="nearest")[0, 0].numpy() > 0
        tile = max(size) // 8
        yy, xx = np.mgrid[: size[0], : size[1]]
        checker = np.where(((yy // tile + xx // tile) % 2 == 0), f, w)
        period = max(2, round(max(n_rows, n_cols) / 16))
        line = np.zeros(size, dtype=bool)
        for coord in (c_row, c_col):
            shifted = coord + period / 2  # lines half a period inside the borders
            slope = np.hypot(*np.gradient(shifted))  # voxels per display pixel; 0 where the edge voxels are stretched
            distance = np.abs(shifted - period * np.round(shifted / period)) / np.maximum(slope, 1e-6)  # pixels
            line |= distance < 0.75
        overlay = np.repeat(w[..., None], 3, axis=-1)
        overlay[line] = (1.0, 0.85, 0.0)
        rows.append([np.repeat(checker[..., None], 3, axis=-1), overlay, _jacobian_colours(d, folds)])
    width = max(panel.shape[1] for row in rows for panel in row) + _QC_GAP  # one column width: panels line up
    lines = [
        np.concatenate([np.pad(p, ((0, _QC_GAP), (0, width - p.shape[1]), (0, 0))) for p in row], 1) for row in rows
    ]
    picture = np.concatenate(lines, axis=0)[:-_QC_GAP, :-_QC_GAP]
    return (picture * 255).round().astype(np.uint8)
