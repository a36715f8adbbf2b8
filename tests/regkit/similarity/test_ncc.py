"""The ncc similarity: invariance to affine intensity changes (beside lncc's), its sign."""

import pytest

from regkit.similarity import build_similarity
from tests.regkit.similarity.cases import smooth_image


def test_ncc_is_invariant_to_affine_intensity_changes():
    f = smooth_image((15, 16), 0)
    g = smooth_image((15, 16), 1)
    ncc = build_similarity("ncc")
    lncc = build_similarity("lncc", window=5)
    for sim in (ncc, lncc):
        assert float(sim(f, 3.0 * g + 7.0)) == pytest.approx(float(sim(f, g)), abs=1e-5)
        assert float(sim(0.01 * f - 2.0, g)) == pytest.approx(float(sim(f, g)), abs=1e-5)
    assert float(ncc(f, -2.0 * f + 1.0)) == pytest.approx(2.0, abs=1e-5)  # signed: inverted contrast is the worst
