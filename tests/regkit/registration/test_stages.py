"""regkit.registration.stages: the CPAB stage's Adam steps scaled by the prior's coherence, and its whitened
parametrization (``Unwhiten``) starting every level at the carried field."""

from __future__ import annotations

import pytest
import torch

from regkit.cpab.module import CPAB
from regkit.io import Image


def test_adam_steps_are_scaled_by_the_priorcoherence() -> None:
    """Adam's learning rate is divided by rms(L 1 / sigma): 1 for nearly independent coordinates, growing with the
    number of vertices one prior length scale spans."""
    from regkit.cpab.prior import VertexPrior
    from regkit.registration.stages import coherence

    independent = VertexPrior(CPAB((4, 4, 4)).basis, length_scale=0.01)
    assert coherence(independent) == pytest.approx(1.0, abs=1e-6)
    values = [coherence(VertexPrior(CPAB((n, n, n)).basis, length_scale=0.1)) for n in (6, 12, 24)]
    assert 1.0 < values[0] < values[1] < values[2]


def test_each_level_starts_from_the_coarser_solution_with_zero_z(brain2d: Image) -> None:
    """The parametrization ``theta = theta_0 + L z`` starts every level at the carried field with z = 0, so the
    level's first steps are not pulled by the prior energy of the carried field."""
    from torch.nn.utils import parametrize

    from regkit.cpab.prior import VertexPrior
    from regkit.registration.stages import Unwhiten

    flow = CPAB.for_grid(brain2d.grid, (8, 8))
    with torch.no_grad():
        flow.theta.normal_(generator=torch.Generator().manual_seed(0))
    start = flow.theta.detach().clone()
    parametrize.register_parametrization(flow, "theta", Unwhiten(flow, VertexPrior(flow.basis)))
    assert torch.count_nonzero(flow.get_parameter("parametrizations.theta.original")) == 0
    torch.testing.assert_close(flow.theta, start)
