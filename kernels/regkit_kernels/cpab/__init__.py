"""Fused Triton kernels for the CPAB facet-resolved expm-step scheme (2D and 3D), forward and the factorized adjoint.

Ladder: ``cpab_fwd_kernel`` / ``cpab_bwd_kernel`` (``kernels.py``) -> launchers ``cpab_fwd`` / ``cpab_bwd`` ->
``CPABIntegrateTriton`` (with ``expm.step_matrices`` / ``step_matrices_vjp`` for ``E`` and ``dL/dA``) ->
``cpab_integrate(points, A, tess, *, t, steps, checkpoint_every)``, which
``regkit.cpab.integrate.integrate(..., backend="triton")`` calls. ``point_order`` sorts points shared by a batch by
their starting cells (the order the kernels take them in). ``cell_velocities(basis, theta)`` is ``basis.to_A(theta)``
(``regkit.cpab.basis``) and its adjoint in one kernel each (``basis.py``).
"""

from regkit_kernels.cpab.basis import cell_velocities
from regkit_kernels.cpab.expm import step_matrices, step_matrices_vjp
from regkit_kernels.cpab.ops import CPABIntegrateTriton, cpab_bwd, cpab_fwd, cpab_integrate, point_order

__all__ = [
    "CPABIntegrateTriton",
    "cell_velocities",
    "cpab_bwd",
    "cpab_fwd",
    "cpab_integrate",
    "point_order",
    "step_matrices",
    "step_matrices_vjp",
]
