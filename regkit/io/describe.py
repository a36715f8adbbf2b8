"""A one-line description of each property of an image (``regkit info``, the napari inspect widget).

Sizes and spacings are given in (x, y[, z]) order, the tensor layout as ``[z, y, x]``, positions in LPS millimetres.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from regkit.io.image import Image
from regkit.io.orientation import orientation_code

__all__ = ["describe_image"]

_ANATOMY = {"L": "Left", "R": "Right", "P": "Posterior", "A": "Anterior", "S": "Superior", "I": "Inferior"}


def _num(value: float) -> str:
    """Compact number: 6 significant digits, no "-0"."""
    text = f"{float(value):.6g}"
    return "0" if text == "-0" else text


def describe_image(img: Image) -> dict[str, str]:
    """One-line strings describing ``img`` (size, spacing, origin, direction, orientation, dtype, range).

    ``direction`` lists the LPS unit vector of each index axis and, for oblique images, the largest angle between an
    index axis and its closest world axis. ``range`` is over finite values, with the NaN/Inf counts when there are any.
    """
    grid = img.grid
    code = orientation_code(grid)
    axes = "xyz"[: img.ndim]
    direction = np.asarray(grid.direction)
    columns = ", ".join(f"{'ijk'[c]} ({', '.join(_num(v) for v in direction[:, c])})" for c in range(img.ndim))
    tilt = math.degrees(math.acos(min(1.0, float(np.abs(direction).max(axis=0).min()))))
    if tilt > 1e-3:
        columns += f"; oblique by up to {tilt:.2f} deg"
    pointing = ", ".join(f"{axis} to {_ANATOMY[c]}" for axis, c in zip("ijk"[: img.ndim], code, strict=True))
    return {
        "size": f"{' x '.join(map(str, grid.size))} ({', '.join(axes)}); tensor [{', '.join(reversed(axes))}]",
        "spacing": f"{' x '.join(_num(s) for s in grid.spacing)} mm",
        "origin": f"({', '.join(_num(o) for o in grid.origin)}) mm LPS",
        "direction": columns,
        "orientation": f"{code} ({pointing})",
        "dtype": str(img.data.dtype).removeprefix("torch."),
        "range": _value_range(img.data),
    }


def _value_range(data: torch.Tensor) -> str:
    """``"min .. max"`` over finite values, plus the NaN/Inf counts if any."""
    if not data.is_floating_point():
        return f"{int(data.min())} .. {int(data.max())}"
    finite = torch.isfinite(data)
    nan = int(torch.isnan(data).sum())
    inf = data.numel() - int(finite.sum()) - nan
    values = data[finite]
    text = f"{_num(values.min().item())} .. {_num(values.max().item())}" if values.numel() else "no finite values"
    return text + (f" ({nan} NaN, {inf} Inf)" if nan or inf else "")
