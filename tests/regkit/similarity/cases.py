"""Shared inputs of the similarity tests: the names of the image measures and a structured random image."""

import torch

from regkit.spatial.filters import gaussian_smooth

NAMES = ["mse", "ncc", "lncc", "mi"]


def smooth_image(shape, seed=0, dtype=torch.float64):
    """A random image with structure at several scales (B, C, *shape)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, *shape, generator=g, dtype=dtype)
    return gaussian_smooth(x, 1.5) + 0.2 * x
