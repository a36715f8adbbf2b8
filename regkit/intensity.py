"""Intensity normalisation: what every similarity measure sees, during registration and in ``metrics.json``.

Tensors are in any layout (``[z, y, x]`` images, or batches of them); the mapping is per call, over all values.
"""

from __future__ import annotations

import torch

__all__ = ["rescale_intensities"]

_PERCENTILES = (0.5, 99.5)


def rescale_intensities(data: torch.Tensor) -> torch.Tensor:
    """Intensities mapped linearly from their 0.5th/99.5th percentiles to [0, 1] and clamped to [-0.5, 1.5], in
    ``data``'s floating dtype (float32 for integer images); a constant image gives zeros. What every similarity
    measure sees during registration."""
    values = data if data.is_floating_point() else data.float()
    flat = values.flatten()
    if flat.numel() > 2**24:  # quantile's input limit; a strided subsample estimates the percentiles as well
        flat = flat[:: flat.numel() // 2**24 + 1]
    q = torch.tensor(_PERCENTILES, device=flat.device) / 100
    lo, hi = torch.quantile(flat.float(), q).tolist()
    if hi <= lo:
        return torch.zeros_like(values)  # a constant image: nothing to align; the similarities stay finite
    return ((values - lo) / (hi - lo)).clamp(-0.5, 1.5)
