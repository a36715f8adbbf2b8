"""The lncc similarity: against a naive windowed implementation, and its closed-form backward (PyTorch and numba
faces)."""

import itertools

import numpy as np
import pytest
import torch

import regkit.similarity.lncc
from regkit.similarity import build_similarity
from tests.regkit.similarity.cases import masked_brain_in_float64_and_float32, smooth_image


def naive_lncc(f, g, w, window, eps):
    """Loop implementation of the masked squared local NCC loss (windows truncated at the border)."""
    f, g, w = f[0, 0].numpy(), g[0, 0].numpy(), w[0, 0].numpy()
    radii = [k // 2 for k in reversed(window)]  # tensor axis order
    cc2 = np.zeros_like(f)
    for p in itertools.product(*(range(s) for s in f.shape)):
        sl = tuple(slice(max(0, q - r), q + r + 1) for q, r in zip(p, radii, strict=True))
        ww, ff, gg = w[sl], f[sl], g[sl]
        n = ww.sum()
        mf, mg = (ww * ff).sum() / n, (ww * gg).sum() / n
        vf = (ww * ff * ff).sum() / n - mf * mf
        vg = (ww * gg * gg).sum() / n - mg * mg
        cov = (ww * ff * gg).sum() / n - mf * mg
        cc2[p] = cov * cov / ((vf + eps) * (vg + eps))
    return 1.0 - (w * cc2).sum() / w.sum()


@pytest.fixture(params=["torch", "numba"])
def lncc_face(request, monkeypatch):
    """The local NCC's PyTorch face, or its fused numba kernels (what ``auto`` takes on the CPU)."""
    monkeypatch.setattr(
        regkit.similarity.lncc, "LNCC_FACES", ("torch", "numba") if request.param == "numba" else ("torch",)
    )
    return request.param


@pytest.mark.parametrize("shape, window", [((7, 9), 3), ((6, 8), (5, 3)), ((5, 6, 7), 3), ((4, 5, 6), (3, 5, 1))])
def test_lncc_equals_a_naive_windowed_implementation(shape, window, lncc_face):
    f = smooth_image(shape, 0)
    g = smooth_image(shape, 1)
    mask = (torch.rand(1, 1, *shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) > 0.3).double()
    sizes = (window,) * len(shape) if isinstance(window, int) else window
    # a tiny eps makes the loss independent of the global standardisation the implementation applies first
    sim = build_similarity("lncc", window=window, eps=1e-12)
    for m in (torch.ones_like(mask), mask):
        expected = naive_lncc(f, g, m, sizes, 1e-12)
        assert float(sim(f, g, m)) == pytest.approx(expected, abs=1e-8)


@pytest.mark.parametrize("window", [3, (5, 3, 1)])
def test_lncc_closed_form_backward_matches_autograd(window, lncc_face):
    """A constant mask takes the closed-form backward (PyTorch or numba); a mask that requires a gradient takes the
    autograd path. Only the PyTorch face is twice differentiable."""
    sim = build_similarity("lncc", window=window)
    mask = (torch.rand(1, 1, 6, 7, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64) > 0.2).double()
    grads = []
    for mask_grad in (False, True):
        f = smooth_image((6, 7, 8), 0).requires_grad_(True)
        g = smooth_image((6, 7, 8), 1).requires_grad_(True)
        m = mask.clone().requires_grad_(mask_grad)
        sim(f, g, m).backward()
        grads.append((f.grad, g.grad))
    torch.testing.assert_close(grads[0], grads[1])
    f = smooth_image((4, 5, 3), 0).requires_grad_(True)
    g = smooth_image((4, 5, 3), 1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: sim(a, b, mask[..., :4, :5, :3]), (f, g))
    if window == 3 and lncc_face == "torch":
        assert torch.autograd.gradgradcheck(lambda a, b: sim(a, b), (f, g))


@pytest.mark.parametrize("ndim", [2, 3])
def test_masked_lncc_in_float32_equals_float64_on_a_brain(ndim, lncc_face):
    """The bundled MNI152 brain under its own brain mask: windows that hold no mask voxel carry only the rounding of
    the box sums (in float32 ~1e-5 of a line's total), which must give cc^2 = 0, not inf; the loss and the gradient in
    float32 agree with float64."""
    (loss64, grad64), (loss32, grad32) = masked_brain_in_float64_and_float32(build_similarity("lncc", window=5), ndim)
    assert torch.isfinite(loss32) and torch.isfinite(grad32).all()
    assert abs(float(loss32 - loss64)) < 1e-4
    assert (grad32 - grad64).abs().max() < 1e-3 * grad64.abs().max()
