"""The typed faces of the compiled kernels: what regkit calls in each ``regkit_kernels`` module.

``regkit._backend.load_kernels(name)`` imports a module at run time and returns it typed as the protocol of its name,
so that mypy checks every call regkit makes into the kernels. Each protocol lists only the functions that regkit calls;
a module satisfies it through its functions (mypy takes modules as protocol implementations), and the block under
``TYPE_CHECKING`` at the end holds every module to its protocol. Nothing here imports the kernels at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    from torch import Tensor

    from regkit.cpab.basis import CPABasis

# ``tess`` is a ``regkit.cpab.tessellation.Tessellation`` wherever regkit passes one. It is typed ``Any`` here because
# ``Tessellation.lower`` and ``upper`` are declared optional (they are set in ``__post_init__``), so mypy would not
# take a Tessellation for the fused kernels' ``Box`` protocol (bounds as sequences of floats).


class CpabFused(Protocol):
    """``regkit_kernels.cpab``: the fused CPAB integration and basis map (Triton, CUDA)."""

    def cpab_integrate(
        self, points: Tensor, A: Tensor, tess: Any, *, t: float = 1.0, steps: int, checkpoint_every: int
    ) -> Tensor: ...

    def cell_velocities(self, basis: CPABasis, theta: Tensor) -> Tensor: ...


class WtconvFused(Protocol):
    """``regkit_kernels.wtconv``: the fused WTConv layer (Triton, CUDA)."""

    def wtconv_fused(
        self,
        x: Tensor,
        base_weight: Tensor,
        base_bias: Tensor | None,
        base_scale: Tensor,
        wavelet_weights: Sequence[Tensor],
        wavelet_scales: Sequence[Tensor],
    ) -> Tensor: ...


class CpabNumba(Protocol):
    """``regkit_kernels.numba.cpab``: the CPAB integration and its factorized adjoint on the CPU."""

    def cpab_integrate(self, points: Tensor, A: Tensor, tess: Any, *, t: float = 1.0, steps: int = 50) -> Tensor: ...


class FiltersNumba(Protocol):
    """``regkit_kernels.numba.filters``: box sums and separable filters on the CPU."""

    def box_sums(self, image: Tensor, sizes: Sequence[int]) -> Tensor: ...

    def separable(self, image: Tensor, kernels: Sequence[Tensor | None], edge: bool) -> Tensor: ...


class LnccNumba(Protocol):
    """``regkit_kernels.numba.lncc``: the squared local NCC map and its image gradient on the CPU."""

    def local_cc2(
        self, f: Tensor, g: Tensor, w: Tensor, window: Sequence[int], eps: float, min_weight: float
    ) -> tuple[Tensor, np.ndarray]: ...

    def local_cc2_backward(
        self,
        f: Tensor,
        g: Tensor,
        w: Tensor,
        stats: np.ndarray,
        grad: Tensor,
        window: Sequence[int],
        eps: float,
        need_f: bool,
    ) -> tuple[Tensor | None, Tensor]: ...


class MiNumba(Protocol):
    """``regkit_kernels.numba.mi``: the Parzen joint histogram and its adjoint on the CPU."""

    def joint_histogram(self, t_f: Tensor, t_g: Tensor, w: Tensor, bins: int) -> Tensor: ...

    def joint_histogram_backward(
        self, t_f: Tensor, t_g: Tensor, w: Tensor, grad: Tensor, bins: int, needs: tuple[bool, ...]
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]: ...


class SamplingNumba(Protocol):
    """``regkit_kernels.numba.sampling``: linear interpolation at voxel indices on the CPU."""

    def linear(self, values: Tensor, index: Tensor) -> Tensor: ...


class CompilesNumba(Protocol):
    """``regkit_kernels.numba.compiles``: the first-use notice of numba's compiles."""

    def announce(self, say: Callable[[str], None]) -> AbstractContextManager[None]: ...


if TYPE_CHECKING:  # mypy holds each kernels module to its face; nothing of this runs
    import regkit_kernels.cpab
    import regkit_kernels.numba.compiles
    import regkit_kernels.numba.cpab
    import regkit_kernels.numba.filters
    import regkit_kernels.numba.lncc
    import regkit_kernels.numba.mi
    import regkit_kernels.numba.sampling
    import regkit_kernels.wtconv

    _cpab: CpabFused = regkit_kernels.cpab
    _wtconv: WtconvFused = regkit_kernels.wtconv
    _cpab_numba: CpabNumba = regkit_kernels.numba.cpab
    _filters: FiltersNumba = regkit_kernels.numba.filters
    _lncc: LnccNumba = regkit_kernels.numba.lncc
    _mi: MiNumba = regkit_kernels.numba.mi
    _sampling: SamplingNumba = regkit_kernels.numba.sampling
    _compiles: CompilesNumba = regkit_kernels.numba.compiles
