"""The mse similarity: its closed form (beside ncc's)."""

import numpy as np
import pytest

from regkit.similarity import build_similarity
from tests.regkit.similarity.cases import smooth_image


def test_mse_and_ncc_closed_form():
    f = smooth_image((12, 13), 0)
    g = smooth_image((12, 13), 1)
    assert float(build_similarity("mse")(f, g)) == pytest.approx(float(((f - g) ** 2).mean()), rel=1e-12)
    r = np.corrcoef(f.flatten().numpy(), g.flatten().numpy())[0, 1]
    assert float(build_similarity("ncc")(f, g)) == pytest.approx(1.0 - r, abs=1e-5)
