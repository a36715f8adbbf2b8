"""CPAB transformations. Contents, in the order they build on each other:

* ``tessellation``: :class:`Tessellation` (cells, closed-form ``locate``);
* ``basis``: :func:`cpa_basis` -> :class:`CPABasis` (``theta`` -> per-cell velocity matrices ``A``), constraints;
* ``prior``: :class:`CPABPrior` (squared-exponential Gaussian prior over ``theta``);
* ``crossing``: the in-cell flow as a polynomial in time, facet hit times, the adjoint of one piece;
* ``scheme``: the facet-resolved expm-step scheme, one step at a time, and its adjoint;
* ``integrate``: :func:`integrate`, :func:`integrate_reference`, the factorized adjoint (:class:`CPABIntegrate`),
  Jacobians, chains;
* ``baselines``: :func:`integrate_accurate` (bisection, an independent check) and the forward-sensitivity gradient;
* ``module``: :class:`CPAB`, the ``torch.nn.Module`` users hold (world frames, displacement fields, warping).

Points are in the tessellation's *domain* coordinates unless a function says otherwise; ``CPAB`` maps LPS world
points to the domain and back.
"""

from regkit.cpab.baselines import forward_sensitivity_gradient, integrate_accurate
from regkit.cpab.basis import BOUNDARY_MODES, CPABasis, constraint_matrix, cpa_basis
from regkit.cpab.integrate import (
    CPABIntegrate,
    count_crossings,
    integrate,
    integrate_chain,
    integrate_reference,
    integrate_trajectory,
    jacobian,
    log_jacobian_determinant,
)
from regkit.cpab.module import CPAB
from regkit.cpab.prior import CPABPrior
from regkit.cpab.scheme import step_matrices
from regkit.cpab.tessellation import Tessellation

__all__ = [
    "BOUNDARY_MODES",
    "CPAB",
    "CPABIntegrate",
    "CPABPrior",
    "CPABasis",
    "Tessellation",
    "constraint_matrix",
    "count_crossings",
    "cpa_basis",
    "forward_sensitivity_gradient",
    "integrate",
    "integrate_accurate",
    "integrate_chain",
    "integrate_reference",
    "integrate_trajectory",
    "jacobian",
    "log_jacobian_determinant",
    "step_matrices",
]
