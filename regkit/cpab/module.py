"""``CPAB``: a CPAB transformation (or a batch of them) as a ``torch.nn.Module`` holding ``theta``.

Frames. The tessellation lives in *domain* coordinates ``p``; LPS world millimetres ``w`` relate to them by
``p = R^T (w - o)`` and ``w = o + R p``, with ``o = origin`` and ``R = direction`` (orthonormal, columns = the domain
axes in world space). :meth:`CPAB.for_grid` takes ``o`` and ``R`` from an image grid and makes the domain box the grid's
voxel edges, so domain coordinates are millimetres along the grid's own axes; built from a tessellation directly, the
frame is the identity (world = domain). Directions of the transformation: ``phi`` maps a fixed-space point to the
moving-space point it samples (pull-back, as ITK displacement fields: ``x_moving = x_fixed + u(x_fixed)``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch

from regkit.cpab.basis import cpa_basis
from regkit.cpab.integrate import DEFAULT_STEPS, integrate, jacobian, log_jacobian_determinant
from regkit.cpab.prior import CPABPrior
from regkit.cpab.tessellation import Tessellation
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image


class CPAB(torch.nn.Module):
    """A CPAB transformation: ``theta`` -> continuous piecewise-affine velocity field -> its flow for time ``t``.

    Args:
        tessellation: a :class:`Tessellation`, or cells per axis (x, y[, z]) with the box ``lower``/``upper``.
        boundary: ``"zero"``, ``"normal"`` or ``"free"`` (see ``regkit.cpab.basis``).
        volume_preserving: constrain every cell's velocity to zero divergence.
        steps: integration steps ``T`` of the expm-step scheme (``regkit.cpab.integrate``).
        length_scale, variance: the prior's squared-exponential covariance (``regkit.cpab.prior.CPABPrior``;
            ``length_scale`` relative to the box).
        backend: ``"auto"``, ``"reference"`` or ``"torch"`` (the factorized adjoint), see ``integrate``.
        batch_size: ``None`` for one transformation (``theta`` of shape ``(d,)``), else ``B`` (``theta (B, d)``).
        origin, direction: the world frame of the domain (module docstring); default the identity. Kept in float64
            (configuration, like the tessellation; not in the ``state_dict``).

    ``theta`` is a float32 :class:`torch.nn.Parameter` initialised to zero (the identity); use ``.double()`` or
    ``.to(device)`` as for any module. Points passed to the methods must have ``theta``'s dtype and device.
    With a batch, methods return a leading ``B`` axis; points are shared by the batch unless ``per_batch=True``
    (then their leading axis is ``B``).
    """

    def __init__(
        self,
        tessellation: Tessellation | Sequence[int],
        *,
        lower: Sequence[float] | None = None,
        upper: Sequence[float] | None = None,
        boundary: str = "zero",
        volume_preserving: bool = False,
        steps: int = DEFAULT_STEPS,
        length_scale: float = 0.1,
        variance: float = 1.0,
        backend: str = "auto",
        batch_size: int | None = None,
        origin: Sequence[float] | None = None,
        direction: np.ndarray | Sequence[Sequence[float]] | None = None,
    ) -> None:
        super().__init__()
        if isinstance(tessellation, Tessellation):
            if lower is not None or upper is not None:
                raise ValueError("give lower/upper only with cells per axis, not with a Tessellation")
            tess = tessellation
        else:
            bounds = [None if v is None else tuple(float(x) for x in v) for v in (lower, upper)]
            tess = Tessellation(tuple(int(c) for c in tessellation), *bounds)
        n = tess.ndim
        self.tess = tess
        self.basis = cpa_basis(tess, boundary, volume_preserving)
        self.length_scale, self.variance = length_scale, variance
        self._prior: CPABPrior | None = None
        self.steps = steps
        self.backend = backend
        shape = (self.basis.d,) if batch_size is None else (int(batch_size), self.basis.d)
        self.theta = torch.nn.Parameter(torch.zeros(shape))
        self.origin = (
            torch.zeros(n, dtype=torch.float64) if origin is None else torch.tensor(origin, dtype=torch.float64)
        )
        self.direction = torch.eye(n, dtype=torch.float64) if direction is None else torch.tensor(np.asarray(direction))
        if self.origin.shape != (n,) or self.direction.shape != (n, n):
            raise ValueError(
                f"origin must have {n} entries and direction {n} x {n}, got {tuple(self.origin.shape)} and "
                f"{tuple(self.direction.shape)}"
            )
        self._frames: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def for_grid(cls, grid: Grid, cells: int | Sequence[int], **kwargs: object) -> CPAB:
        """A CPAB whose domain is ``grid``'s physical box in the grid's own axis-aligned frame.

        Domain coordinates are ``p = direction^T (world - origin)``: millimetres along the index axes, with voxel
        centre ``i`` at ``p = i * spacing``; the box spans the voxel edges, ``-spacing / 2`` to
        ``(size - 1/2) * spacing`` per axis. ``cells`` per axis (x, y[, z]), or one count for every axis; other
        keyword arguments as the constructor.
        """
        counts = (cells,) * grid.ndim if isinstance(cells, int) else tuple(cells)
        spacing, size = np.asarray(grid.spacing), np.asarray(grid.size)
        return cls(
            counts,
            lower=tuple(-0.5 * spacing),
            upper=tuple((size - 0.5) * spacing),
            origin=grid.origin,
            direction=grid.direction,
            **kwargs,  # type: ignore[arg-type]
        )

    def extra_repr(self) -> str:
        return (
            f"cells={self.tess.shape}, boundary={self.basis.boundary!r}, "
            f"volume_preserving={self.basis.volume_preserving}, d={self.basis.d}, theta={tuple(self.theta.shape)}, "
            f"steps={self.steps}, backend={self.backend!r}"
        )

    @property
    def prior(self) -> CPABPrior:
        """The prior over theta, built on first use (its factorisation takes seconds on fine 3D tessellations)."""
        if self._prior is None:
            self._prior = CPABPrior(self.basis, length_scale=self.length_scale, variance=self.variance)
        return self._prior

    @property
    def batched(self) -> bool:
        return self.theta.ndim == 2

    # ---- frames --------------------------------------------------------------------------------------------------

    def _frame(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``origin`` and ``direction`` in ``like``'s dtype and device, converted once per dtype and device: a copy
        from the host on every call would wait for the GPU and could not be part of a CUDA graph."""
        key = (like.device, like.dtype)
        if key not in self._frames:
            self._frames[key] = (self.origin.to(like.device, like.dtype), self.direction.to(like.device, like.dtype))
        return self._frames[key]

    def world_to_domain(self, world: torch.Tensor) -> torch.Tensor:
        """LPS world points ``(..., n)`` -> domain points ``(..., n)``: ``R^T (w - o)``."""
        origin, direction = self._frame(world)
        return (world - origin) @ direction

    def domain_to_world_matrix(self, like: torch.Tensor) -> torch.Tensor:
        """The homogeneous ``(n + 1, n + 1)`` matrix of :meth:`domain_to_world` (``[[R, o], [0, 1]]``), in ``like``'s
        dtype and device, for composing it with other affine maps."""
        origin, direction = self._frame(like)
        n = direction.shape[0]
        matrix = torch.zeros((n + 1, n + 1), dtype=like.dtype, device=like.device)
        matrix[:n, :n] = direction
        matrix[:n, n] = origin
        matrix[n, n] = 1.0
        return matrix

    def domain_to_world(self, points: torch.Tensor) -> torch.Tensor:
        """Domain points ``(..., n)`` -> LPS world points ``(..., n)``: ``o + R p``."""
        origin, direction = self._frame(points)
        return origin + points @ direction.T

    # ---- the transformation --------------------------------------------------------------------------------------

    def cell_matrices(self) -> torch.Tensor:
        """The per-cell velocity matrices ``A = to_A(theta)``: ``(C, n, n + 1)`` or ``(B, C, n, n + 1)``."""
        # the basis map has one PyTorch face: the integration's reference and torch faces both take it
        return self.basis.to_A(self.theta, backend=self.backend if self.backend in ("auto", "triton") else "torch")

    def _flat(self, points: torch.Tensor, per_batch: bool) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Points as ``(N, n)`` (shared) or ``(B, N, n)``; and the result's leading shape."""
        n = self.tess.ndim
        if points.shape[-1] != n:
            raise ValueError(f"points must have shape (..., {n}), got {tuple(points.shape)}")
        if per_batch:
            if not self.batched or points.ndim < 2 or points.shape[0] != self.theta.shape[0]:
                raise ValueError(f"per_batch points need shape ({self.theta.shape[0]}, ..., {n}) and a batched CPAB")
            return points.reshape(points.shape[0], -1, n), points.shape[:-1]
        lead = (self.theta.shape[0], *points.shape[:-1]) if self.batched else points.shape[:-1]
        return points.reshape(-1, n), lead

    def transform_points(self, points: torch.Tensor, t: float = 1.0, *, per_batch: bool = False) -> torch.Tensor:
        """``phi_t(points)``, the flow for time ``t``, at domain points ``(..., n)``: ``(B?, ..., n)`` domain points."""
        flat, lead = self._flat(points, per_batch)
        out = integrate(flat, self.cell_matrices(), self.tess, t=t, steps=self.steps, backend=self.backend)
        return out.reshape(*lead, self.tess.ndim)

    def forward(self, points: torch.Tensor, t: float = 1.0) -> torch.Tensor:
        """Same as :meth:`transform_points` (domain coordinates)."""
        return self.transform_points(points, t)

    def transform_world(self, world_points: torch.Tensor, t: float = 1.0, *, per_batch: bool = False) -> torch.Tensor:
        """``phi_t`` on LPS world points ``(..., n)`` -> world points ``(B?, ..., n)`` (world -> domain -> flow ->
        world)."""
        moved = self.transform_points(self.world_to_domain(world_points), t, per_batch=per_batch)
        return self.domain_to_world(moved)

    def transform_grid(self, grid: Grid, t: float = 1.0) -> torch.Tensor:
        """Displacement field ``u`` at ``grid``'s voxel centres, ``(B?, *grid.shape, n)`` in world millimetres (LPS
        components, (x, y[, z]) order), pull-back: ``x_moving = x_fixed + u(x_fixed)``."""
        world = grid.world_points(self.theta.dtype, self.theta.device)
        return self.transform_world(world, t) - world

    def warp(
        self,
        image: torch.Tensor,
        moving_grid: Grid,
        fixed_grid: Grid,
        mode: str = "linear",
        padding: float = 0.0,
    ) -> torch.Tensor:
        """The moving ``image`` (``(*moving_grid.shape)`` or ``(C, *moving_grid.shape)``) resampled onto
        ``fixed_grid``: value at fixed voxel ``x`` = ``image(phi(x))``. Returns ``(B?, C?, *fixed_grid.shape)``;
        ``mode`` and ``padding`` as ``regkit.spatial.sampling.sample_image``. Differentiable in ``theta``."""
        world = fixed_grid.world_points(self.theta.dtype, self.theta.device)
        values = sample_image(image, moving_grid, self.transform_world(world), mode=mode, padding=padding)
        channels = image.ndim == moving_grid.ndim + 1
        return values.movedim(0, 1) if channels and self.batched else values

    def velocity(self, points: torch.Tensor) -> torch.Tensor:
        """The velocity ``v(p) = A_c [p; 1]`` at domain points ``(..., n)``: ``(B?, ..., n)``, domain units."""
        if self.batched:
            points = points.expand(self.theta.shape[0], *points.shape)
        return self.basis.velocity(self.theta, points)

    def _domain_points(self, points_or_grid: torch.Tensor | Grid) -> torch.Tensor:
        if isinstance(points_or_grid, Grid):
            return self.world_to_domain(points_or_grid.world_points(self.theta.dtype, self.theta.device))
        return points_or_grid

    def jacobian_determinant(self, points_or_grid: torch.Tensor | Grid, t: float = 1.0) -> torch.Tensor:
        """``det(d phi_t / d x)`` at domain points ``(..., n)``, or at a grid's voxel centres: ``(B?, ...)``.

        Analytic for the integration scheme: ``exp(h sum_s tr A_lin(c_s))`` over the visited cells, positive by
        construction; the same in world and domain frames (they differ by a rotation).
        """
        points = self._domain_points(points_or_grid)
        flat, lead = self._flat(points, False)
        logdet = log_jacobian_determinant(flat, self.cell_matrices(), self.tess, t=t, steps=self.steps)
        return logdet.exp().reshape(lead)

    def jacobian(self, points_or_grid: torch.Tensor | Grid, t: float = 1.0) -> torch.Tensor:
        """Jacobian matrices ``d phi_t / d p`` ``(B?, ..., n, n)`` in the domain frame (``[i, j] = d phi_i / d p_j``)
        at domain points or a grid's voxel centres; in the world frame it is ``R J R^T``."""
        points = self._domain_points(points_or_grid)
        flat, lead = self._flat(points, False)
        n = self.tess.ndim
        return jacobian(flat, self.cell_matrices(), self.tess, t=t, steps=self.steps).reshape(*lead, n, n)

    # ---- new transformations -------------------------------------------------------------------------------------

    def with_theta(self, theta: torch.Tensor) -> CPAB:
        """A copy sharing the tessellation, basis and prior, with new (detached) parameters."""
        shared = {id(self.tess): self.tess, id(self.basis): self.basis, id(self._prior): self._prior}
        other = copy.deepcopy(self, shared)
        with torch.no_grad():
            other.theta.copy_(theta)
        return other

    def inverse(self) -> CPAB:
        """The inverse transformation: the flow of ``-theta`` (exact for the flow; the ``steps``-step scheme inverts
        up to its discretisation error)."""
        return self.with_theta(-self.theta.detach())

    def sample(self, generator: torch.Generator, scale: float = 1.0) -> CPAB:
        """A new CPAB (same tessellation, frame and batch size) with ``theta`` drawn from the prior, its standard
        deviation times ``scale``: random diffeomorphisms for augmentation and demos."""
        n = self.theta.shape[0] if self.batched else None
        theta = self.prior.sample_theta(n, generator=generator, scale=scale)
        return self.with_theta(theta.to(self.theta.device, self.theta.dtype))

    def prior_energy(self) -> torch.Tensor:
        """``1/2 theta^T Sigma_theta^-1 theta`` of the prior: a scalar, or ``(B,)``."""
        return self.prior.energy(self.theta)
