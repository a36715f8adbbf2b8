"""Fused Triton kernels for the CPAB expm-step scheme (2D and 3D), forward and the factorized adjoint.

Ladder: ``_cpab_fwd_kernel`` / ``_cpab_bwd_kernel`` (``kernels.py``) -> launchers ``cpab_fwd`` / ``cpab_bwd`` ->
``CPABIntegrateTriton`` -> ``cpab_integrate(points, E, tess, *, steps, checkpoint_every)``, which
``regkit.cpab.integrate.integrate(..., backend="triton")`` calls with ``E = step_matrices(A, t / steps)``.
"""

from regkit_kernels.cpab.ops import CPABIntegrateTriton, cpab_bwd, cpab_fwd, cpab_integrate

__all__ = ["CPABIntegrateTriton", "cpab_bwd", "cpab_fwd", "cpab_integrate"]
