"""What every image measure shares (regkit.similarity.base): best value on identical images, masks, degenerate
inputs and gradients."""

import pytest
import torch

from regkit.errors import ImageValueError, RegkitError
from regkit.similarity import build_similarity
from tests.regkit.similarity.cases import NAMES, smooth_image


@pytest.mark.parametrize("shape", [(17, 19), (9, 10, 11)])
def test_identical_images_give_the_best_value(shape, float_dtype, device):
    f = smooth_image(shape, 0, float_dtype).to(device)
    g = smooth_image(shape, 1, float_dtype).to(device)
    for name in ["mse", "ncc", "lncc"]:
        sim = build_similarity(name)
        # lncc's eps (1e-5 of the global variance per local variance) leaves a few 1e-5 on identical images
        tol = 1e-4 if name == "lncc" or float_dtype == torch.float32 else 1e-6
        assert float(sim(f, f)) == pytest.approx(0.0, abs=tol), name
        assert float(sim(f, g)) > 0.1, name
    mi = build_similarity("mi")
    assert float(mi(f, f)) < float(mi(f, g)) - 0.5


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


@pytest.mark.parametrize("name", NAMES)
def test_constant_images_are_finite(name, float_dtype):
    f = smooth_image((10, 11, 12), 0, float_dtype)
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
