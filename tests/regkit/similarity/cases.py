"""Shared inputs of the similarity tests: the names of the image measures, a structured random image, and a loss and
gradient on a masked brain in float64 and float32."""

import torch

from regkit.spatial.filters import gaussian_smooth

NAMES = ["mse", "ncc", "lncc", "mi"]


def smooth_image(shape, seed=0, dtype=torch.float64):
    """A random image with structure at several scales (B, C, *shape)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, *shape, generator=g, dtype=dtype)
    return gaussian_smooth(x, 1.5) + 0.2 * x


def masked_brain_in_float64_and_float32(sim, ndim):
    """``sim``'s loss and gradient (for the moving image) between the bundled MNI152 brain (2 mm; in 2D its middle
    axial slice) and a shifted, rescaled copy, under the brain's mask (intensity above 0.2 of its maximum): ``[(loss,
    grad) in float64, (loss, grad) in float32]``, both as float64."""
    from regkit.demo import load_template

    brain = load_template().data.double()
    brain = brain / brain.max()
    if ndim == 2:
        brain = brain[brain.shape[0] // 2]
    moved, mask = torch.roll(brain, 2, 0) * 0.9 + 0.02, (brain > 0.2).double()
    results = []
    for dtype in (torch.float64, torch.float32):
        moving = moved[None, None].to(dtype).requires_grad_(True)
        loss = sim(brain[None, None].to(dtype), moving, mask[None, None].to(dtype))
        loss.backward()
        results.append((loss.detach().double(), moving.grad.double()))
    return results
