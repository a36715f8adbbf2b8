"""The mi similarity: monotone remaps against shuffles, the chunked histogram, and its numba face."""

import pytest
import torch

import regkit.similarity.mi
from regkit.similarity import build_similarity
from tests.regkit.similarity.cases import smooth_image


def test_mi_prefers_a_monotone_remap_to_a_shuffle():
    f = smooth_image((24, 25), 0)
    remapped = torch.exp(2.0 * f)
    shuffled = remapped.flatten()[torch.randperm(remapped.numel(), generator=torch.Generator().manual_seed(1))]
    mi = build_similarity("mi", bins=24)
    related = float(mi(f, remapped))
    assert related < float(mi(f, shuffled.view_as(f))) - 1.0
    assert float(mi(f, -f)) == pytest.approx(float(mi(f, f)), abs=0.05)  # MI ignores the sign of the contrast


def test_mi_chunked_histogram_and_gradients(monkeypatch):
    f = smooth_image((6, 7), 0)
    g = smooth_image((6, 7), 1)
    mask = 0.2 + 0.8 * torch.rand(1, 1, 6, 7, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    sim = build_similarity("mi", bins=10)
    whole = float(sim(f, g, mask))
    monkeypatch.setattr(regkit.similarity.mi, "HIST_CHUNK", 10)
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
        monkeypatch.setattr(regkit.similarity.mi, "MI_FACES", faces)
        inputs = [x.clone().requires_grad_(True) for x in (f, g, mask)]
        loss = sim(*inputs)
        results.append((loss.detach(), *torch.autograd.grad(loss, inputs)))
    for torch_face, numba_face in zip(*results, strict=True):
        torch.testing.assert_close(numba_face, torch_face, rtol=1e-9, atol=1e-12)
    inputs = (f.requires_grad_(True), g.requires_grad_(True), mask.requires_grad_(True))
    assert torch.autograd.gradcheck(lambda a, b, m: sim(a, b, m), inputs)
