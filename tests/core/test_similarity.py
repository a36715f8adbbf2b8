"""Similarity losses: registry, closed-form values, invariances, masks, degenerate inputs and gradients."""

import itertools

import numpy as np
import pytest
import torch

import regkit.similarity
from regkit.errors import ConfigError, ImageValueError, RegkitError
from regkit.similarity import SIMILARITIES, Similarity, build_similarity, register_similarity

NAMES = ["mse", "ncc", "lncc", "mi"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def smooth_image(shape, seed=0, dtype=torch.float64):
    """A random image with structure at several scales (B, C, *shape)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, *shape, generator=g, dtype=dtype)
    from regkit.spatial.filters import gaussian_smooth

    return gaussian_smooth(x, 1.5) + 0.2 * x


# --- registry -------------------------------------------------------------------------------------------------------


def test_registry_names_and_errors():
    assert set(NAMES) <= set(SIMILARITIES)
    for name in NAMES:
        assert isinstance(build_similarity(name), SIMILARITIES[name])
    with pytest.raises(ConfigError, match="did you mean 'lncc'"):
        build_similarity("lnc")
    with pytest.raises(ConfigError, match="did you mean 'window'"):
        build_similarity("lncc", windw=5)
    with pytest.raises(ConfigError, match="odd"):
        build_similarity("lncc", window=4)
    with pytest.raises(ConfigError, match="bins"):
        build_similarity("mi", bins=2)
    with pytest.raises(ConfigError, match="percentiles"):
        build_similarity("mi", percentiles=(90, 10))
    assert build_similarity("lncc", window=[3, 5, 7]).window == [3, 5, 7]
    assert build_similarity("mi", bins=16).bins == 16


def test_registry_is_open_for_new_measures():
    @register_similarity("test_l1")
    class L1(Similarity):
        def _loss(self, fixed, warped, weights):
            return ((fixed - warped).abs() * weights).sum() / weights.sum() / fixed.shape[1]

    try:
        sim = build_similarity("test_l1")
        assert sim.name == "test_l1"
        assert float(sim(torch.zeros(1, 1, 3, 3), torch.ones(1, 1, 3, 3))) == pytest.approx(1.0)
        with pytest.raises(ValueError, match="already registered"):
            register_similarity("test_l1")(L1)
    finally:
        del SIMILARITIES["test_l1"]


# --- values ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(17, 19), (9, 10, 11)])
def test_identical_images_give_the_best_value(shape, dtype, device):
    f = smooth_image(shape, 0, dtype).to(device)
    g = smooth_image(shape, 1, dtype).to(device)
    for name in ["mse", "ncc", "lncc"]:
        sim = build_similarity(name)
        # lncc's eps (1e-5 of the global variance per local variance) leaves a few 1e-5 on identical images
        tol = 1e-4 if name == "lncc" or dtype == torch.float32 else 1e-6
        assert float(sim(f, f)) == pytest.approx(0.0, abs=tol), name
        assert float(sim(f, g)) > 0.1, name
    mi = build_similarity("mi")
    assert float(mi(f, f)) < float(mi(f, g)) - 0.5


def test_mse_and_ncc_closed_form():
    f = smooth_image((12, 13), 0)
    g = smooth_image((12, 13), 1)
    assert float(build_similarity("mse")(f, g)) == pytest.approx(float(((f - g) ** 2).mean()), rel=1e-12)
    r = np.corrcoef(f.flatten().numpy(), g.flatten().numpy())[0, 1]
    assert float(build_similarity("ncc")(f, g)) == pytest.approx(1.0 - r, abs=1e-5)


def test_ncc_is_invariant_to_affine_intensity_changes():
    f = smooth_image((15, 16), 0)
    g = smooth_image((15, 16), 1)
    ncc = build_similarity("ncc")
    lncc = build_similarity("lncc", window=5)
    for sim in (ncc, lncc):
        assert float(sim(f, 3.0 * g + 7.0)) == pytest.approx(float(sim(f, g)), abs=1e-5)
        assert float(sim(0.01 * f - 2.0, g)) == pytest.approx(float(sim(f, g)), abs=1e-5)
    assert float(ncc(f, -2.0 * f + 1.0)) == pytest.approx(2.0, abs=1e-5)  # signed: inverted contrast is the worst


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
        regkit.similarity, "_LNCC_FACES", ("torch", "numba") if request.param == "numba" else ("torch",)
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


def test_mi_prefers_a_monotone_remap_to_a_shuffle():
    f = smooth_image((24, 25), 0)
    remapped = torch.exp(2.0 * f)
    shuffled = remapped.flatten()[torch.randperm(remapped.numel(), generator=torch.Generator().manual_seed(1))]
    mi = build_similarity("mi", bins=24)
    related = float(mi(f, remapped))
    assert related < float(mi(f, shuffled.view_as(f))) - 1.0
    assert float(mi(f, -f)) == pytest.approx(float(mi(f, f)), abs=0.05)  # MI ignores the sign of the contrast


# --- masks ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_mask_restricts_the_similarity(name):
    f = smooth_image((20, 20), 0)
    g = f.clone()
    g[..., :, 10:] = smooth_image((20, 10), 3)  # differs on the right half only
    mask = torch.zeros(1, 1, 20, 20, dtype=torch.float64)
    mask[..., :, :10] = 1.0
    sim = build_similarity(name, window=5) if name == "lncc" else build_similarity(name)
    masked, unmasked = float(sim(f, g, mask)), float(sim(f, g))
    if name == "mi":
        left = f[..., :, :10].contiguous()
        assert masked == pytest.approx(float(sim(left, left)), abs=1e-9)
        assert masked < unmasked - 0.3
    else:
        assert masked == pytest.approx(0.0, abs=1e-4)
        assert unmasked > 0.05
    # a batch mask of 1 broadcasts over the batch; batch elements are averaged
    fb, gb = torch.cat([f, f]), torch.cat([g, f])
    assert float(sim(fb, gb, mask)) == pytest.approx(0.5 * (masked + float(sim(f, f, mask))), abs=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_empty_mask_and_bad_shapes_raise(name):
    f = smooth_image((8, 9), 0)
    sim = build_similarity(name)
    mask = torch.ones(2, 1, 8, 9, dtype=torch.float64)
    mask[1] = 0.0
    with pytest.raises(ImageValueError, match="mask is empty"):
        sim(torch.cat([f, f]), torch.cat([f, f]), mask)
    assert issubclass(ImageValueError, RegkitError)
    with pytest.raises(ValueError, match="one shape"):
        sim(f, f[..., :8])
    with pytest.raises(ValueError, match="mask must have shape"):
        sim(f, f, mask[:, :, :4])


# --- degenerate inputs and gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", NAMES)
def test_constant_images_are_finite(name, dtype):
    f = smooth_image((10, 11, 12), 0, dtype)
    for fixed, warped in [
        (f, torch.full_like(f, 5.0)),
        (torch.full_like(f, 2.0), torch.full_like(f, 2.0)),
        (torch.zeros_like(f), torch.zeros_like(f)),
        (f, torch.zeros_like(f)),
    ]:
        warped = warped.clone().requires_grad_(True)
        loss = build_similarity(name)(fixed, warped)
        loss.backward()
        assert torch.isfinite(loss), name
        assert torch.isfinite(warped.grad).all(), name


@pytest.mark.parametrize("name", NAMES)
def test_gradients_are_finite_and_nonzero(name):
    f = smooth_image((9, 10, 11), 0, torch.float32)
    g = smooth_image((9, 10, 11), 1, torch.float32).requires_grad_(True)
    build_similarity(name)(f, g).backward()
    assert torch.isfinite(g.grad).all()
    assert float(g.grad.abs().max()) > 0.0


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_float64(name):
    params = {"lncc": {"window": 3}, "mi": {"bins": 8}}.get(name, {})
    sim = build_similarity(name, **params)
    f = smooth_image((5, 6), 0)
    g = smooth_image((5, 6), 1).requires_grad_(True)
    mask = 0.3 + 0.7 * torch.rand(1, 1, 5, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    mask.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda w, m: sim(f, w, m), (g, mask))
    g3 = smooth_image((3, 4, 5), 2).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda w: sim(smooth_image((3, 4, 5), 3), w), (g3,))


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


def test_mi_chunked_histogram_and_gradients(monkeypatch):
    f = smooth_image((6, 7), 0)
    g = smooth_image((6, 7), 1)
    mask = 0.2 + 0.8 * torch.rand(1, 1, 6, 7, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    sim = build_similarity("mi", bins=10)
    whole = float(sim(f, g, mask))
    monkeypatch.setattr("regkit.similarity._HIST_CHUNK", 10)
    assert float(sim(f, g, mask)) == pytest.approx(whole, rel=1e-12)
    inputs = (f.requires_grad_(True), g.requires_grad_(True), mask.requires_grad_(True))
    assert torch.autograd.gradcheck(lambda a, b, m: sim(a, b, m), inputs)


@pytest.mark.parametrize("shape", [(9, 11), (5, 6, 7)])
def test_mi_numba_face_equals_the_torch_face(shape, monkeypatch):
    """The joint histogram's numba face (what ``auto`` takes on the CPU) against its PyTorch face: loss and the
    gradients for both images and the mask; gradcheck of the numba face."""
    f = smooth_image(shape, 0)
    g = torch.exp(smooth_image(shape, 1))
    generator = torch.Generator().manual_seed(7)
    mask = 0.2 + 0.8 * torch.rand(1, 1, *shape, generator=generator, dtype=torch.float64)
    sim = build_similarity("mi", bins=12)
    results = []
    for faces in (("torch",), ("torch", "numba")):
        monkeypatch.setattr(regkit.similarity, "_MI_FACES", faces)
        inputs = [x.clone().requires_grad_(True) for x in (f, g, mask)]
        loss = sim(*inputs)
        results.append((loss.detach(), *torch.autograd.grad(loss, inputs)))
    for torch_face, numba_face in zip(*results, strict=True):
        torch.testing.assert_close(numba_face, torch_face, rtol=1e-9, atol=1e-12)
    inputs = (f.requires_grad_(True), g.requires_grad_(True), mask.requires_grad_(True))
    assert torch.autograd.gradcheck(lambda a, b, m: sim(a, b, m), inputs)
