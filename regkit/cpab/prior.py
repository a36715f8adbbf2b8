"""The squared-exponential Gaussian prior over CPA velocity fields, in theta coordinates.

Definition (libcpab / FG-CPAB, made independent of the basis and of the domain's units). The prior is stated on the
*normalised* cell maps ``Â_c``, which act on ``u = (x - lower) / (upper - lower)`` in the unit box and give
velocities in box extents per unit time: ``vec(Â_c) = J vec(A_c)``, ``Â_c = E^-1 A_c T`` with
``E = diag(upper - lower)``, ``T = [[E, lower], [0, 1]]`` (``Â = A`` for the unit box). Entries of ``vec(Â)`` are
Gaussian with zero mean and

    Sigma_Â[(c, a, m), (c', a', m')] = variance * exp(-|u_c - u_c'|^2 / (2 length_scale^2)) * [a == a'] [m == m']

with ``u_c`` the cell barycentres in the unit box (``length_scale`` is relative to the box). ``B̂ = J B`` maps theta to
``vec(Â)``. theta's covariance is that of the least-squares coordinates of the projection of ``Â`` onto the
admissible fields:

    Sigma_theta = B̂^+ Sigma_Â B̂^+T = G^-1 M G^-1,   M = B̂^T Sigma_Â B̂,   G = B̂^T B̂.

For an orthonormal basis (libcpab's SVD basis, unit box) this is libcpab's ``B^T Sigma_A B``; unlike that formula
applied to a non-orthonormal basis, it gives every field the same energy whatever basis represents it (nodal,
volume-preserving, SVD) and whatever units the box is in. ``M`` gets a relative ``jitter`` on its diagonal
(``M[i, i] *= 1 + jitter``) because the Gaussian kernel makes it numerically singular on fine tessellations.
Energy: ``1/2 theta^T Sigma_theta^-1 theta = 1/2 (G theta)^T M^-1 (G theta)``.

Computation. In the nodal basis different velocity components never share a row of ``B̂``, so ``M`` and ``G`` are
block-diagonal, one block per component (one dense block with volume preservation: ``R^T M_nodal R``); each
needs only ``V x V`` vertex matrices: ``G_v = sum_c P_c^T P_c`` and ``S = sum_m P_m^T K P_m`` (``K`` the ``C x C``
kernel, ``P_m[c, v] = inv(M̂_c)[k, m]`` for the vertex ``v`` in slot ``k`` of cell ``c``, ``M̂_c`` with the unit-box
vertices). ``K`` is never stored: it is built in column chunks of at most ``_CHUNK_ELEMENTS`` entries, so memory is
``O(V^2 + C * chunk)``; time ``O(C^2 (n + 1)^2)`` for ``S`` plus ``O(V^3)`` Cholesky factorisations per block.
Measured (zero boundary): 2D 32 x 32 0.5 s, 3D 16^3 8.4 s on 16 CPU cores; on one thread of a busy 2-core
machine 2D 32 x 32 ~2.5 s, 3D 8^3 ~0.5 s, 3D 16^3 ~35 s.

Use in optimisation: optimise whitened coordinates ``z`` with ``theta = unwhiten(z)``; then
``energy(theta) = 1/2 |z|^2`` and the problem is well conditioned. ``whiten`` is the inverse map.
"""

from __future__ import annotations

import math

import torch

from regkit.cpab.basis import CPABasis, cell_inverses

# Largest K chunk (entries, float64: 256 MiB) assembled at once.
_CHUNK_ELEMENTS = 2**25
# Largest dense matrix side that covariance_theta / covariance_A build.
_MAX_DENSE = 16384


def _coo(rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    coo = torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, shape, check_invariants=True)
    return coo.coalesce()


def _normalised_centres(basis: CPABasis) -> torch.Tensor:
    tess = basis.tess
    lower = torch.tensor(tess.lower, dtype=torch.float64)
    return (tess.centers() - lower) / (torch.tensor(tess.upper, dtype=torch.float64) - lower)


def unit_box_jacobian(basis: CPABasis) -> torch.Tensor:
    """``J`` (``n (n + 1)`` square, float64) with ``vec(Â_c) = J vec(A_c)`` (row-major ``vec``, same for all cells)."""
    tess = basis.tess
    n = tess.ndim
    lower = torch.tensor(tess.lower, dtype=torch.float64)
    extent = torch.tensor(tess.upper, dtype=torch.float64) - lower
    to_domain = torch.eye(n + 1, dtype=torch.float64)  # T: [u; 1] -> [x; 1]
    to_domain[:n, :n] = torch.diag(extent)
    to_domain[:n, n] = lower
    return torch.kron(torch.diag(1 / extent), to_domain.T.contiguous())  # vec(E^-1 X T) = (E^-1 ⊗ T^T) vec(X)


def _vertex_gram(basis: CPABasis) -> torch.Tensor:
    """``G_v = sum_m P_m^T P_m`` (``V x V`` float64): the Gram matrix of the unit-box vertex hat functions' maps."""
    tess = basis.tess
    inverse = torch.from_numpy(cell_inverses(tess, normalised=True))
    ids = tess.cell_vertex_ids()
    gram = torch.zeros(tess.n_vertices, tess.n_vertices, dtype=torch.float64)
    gram.index_put_((ids[:, :, None], ids[:, None, :]), inverse @ inverse.transpose(1, 2), accumulate=True)
    return gram


def _vertex_kernel(basis: CPABasis, length_scale: float) -> torch.Tensor:
    """``S = sum_m P_m^T K P_m`` (``V x V`` float64, unit variance; see the module docstring), K in column chunks."""
    tess = basis.tess
    n_cells, n_verts, n = tess.n_cells, tess.n_vertices, tess.ndim
    centres = _normalised_centres(basis) / (math.sqrt(2.0) * length_scale)  # K = exp(-|c_i - c_j|^2)
    sq_norms = centres.square().sum(dim=1)
    inverse = torch.from_numpy(cell_inverses(tess, normalised=True))  # (C, k, m)
    ids = tess.cell_vertex_ids()
    slots = torch.arange(n + 1)
    cells = torch.arange(n_cells)[:, None, None].expand(-1, n + 1, n + 1)
    # P^T stacked over m: row m V + v, column c, value inverse[c, k, m] where ids[c, k] = v
    stacked = _coo(
        (slots * n_verts + ids[:, :, None]).flatten(), cells.flatten(), inverse.flatten(), ((n + 1) * n_verts, n_cells)
    )
    out = torch.zeros(n_verts, n_verts, dtype=torch.float64)
    width = max(1, _CHUNK_ELEMENTS // n_cells)
    for start in range(0, n_cells, width):
        chunk = slice(start, min(n_cells, start + width))
        sq_dist = torch.addmm(sq_norms[:, None] + sq_norms[None, chunk], centres, centres[chunk].T, alpha=-2.0)
        kernel = sq_dist.clamp_(min=0.0).neg_().exp_()  # K[:, chunk]
        w = (stacked @ kernel).view(n + 1, n_verts, -1)  # w[m] = P_m^T K[:, chunk], (V, r)
        for k in range(n + 1):
            column = w[0] * inverse[chunk, k, 0]  # (P^T K P)[:, ids[c, k]] gets sum_m inverse[c, k, m] w[m][:, c]
            for m in range(1, n + 1):
                column.addcmul_(w[m], inverse[chunk, k, m])
            out.index_add_(1, ids[chunk, k], column)
    return (out + out.T) / 2


def _check_hyperparameters(length_scale: float, variance: float, jitter: float) -> None:
    """ValueError unless ``length_scale`` and ``variance`` are finite and positive and ``jitter`` finite and >= 0."""
    for name, value in (("length_scale", length_scale), ("variance", variance)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"CPAB prior {name} must be finite and positive, got {value}")
    if not (math.isfinite(jitter) and jitter >= 0):
        raise ValueError(f"CPAB prior jitter must be finite and >= 0, got {jitter}")


class CPABPrior:
    """Gaussian prior ``theta ~ N(0, Sigma_theta)`` with a squared-exponential covariance over cell centres.

    ``length_scale`` is relative to the box (cell centres normalised to the unit box); ``variance`` scales the
    covariance of every entry of the normalised cell maps; ``jitter`` is the relative diagonal regularisation of
    ``M``. Built once per basis (see the module docstring for the definition and costs).
    """

    def __init__(self, basis: CPABasis, length_scale: float = 0.1, variance: float = 1.0, *, jitter: float = 1e-6):
        _check_hyperparameters(length_scale, variance, jitter)
        self.basis = basis
        self.length_scale = float(length_scale)
        self.variance = float(variance)
        self.jitter = float(jitter)
        self._blocks = [self._factor(index, m, g) for index, m, g in self._blocks_mg()]
        self._device_cache: dict[tuple[torch.dtype, torch.device], list[tuple[torch.Tensor, ...]]] = {}

    def _blocks_mg(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(index (k,), M block (k, k), G block (k, k))`` triples tiling ``M`` and ``G`` block-diagonally."""
        basis, tess = self.basis, self.basis.tess
        kernel, gram = _vertex_kernel(basis, self.length_scale), _vertex_gram(basis)
        extent = torch.tensor(tess.upper, dtype=torch.float64) - torch.tensor(tess.lower, dtype=torch.float64)
        blocks = []
        for axis in range(tess.ndim):
            index = torch.nonzero(basis.free_axis == axis).flatten()
            verts, w = basis.free_vertex[index], basis.scale[index] / extent[axis]  # unit-box velocity per theta_i
            scaled = [w[:, None] * vertex[verts][:, verts] * w[None, :] for vertex in (kernel, gram)]
            blocks.append((index, self.variance * scaled[0], scaled[1]))
        if basis.reduction is None:
            return [block for block in blocks if block[0].numel()]
        if basis.d == 0:
            return []
        m_nodal, g_nodal = (torch.zeros(basis.d_nodal, basis.d_nodal, dtype=torch.float64) for _ in range(2))
        for index, m, g in blocks:
            m_nodal[index[:, None], index[None, :]] = m
            g_nodal[index[:, None], index[None, :]] = g
        r = basis.reduction
        return [(torch.arange(basis.d), r.T @ m_nodal @ r, r.T @ g_nodal @ r)]

    def _factor(self, index: torch.Tensor, m: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(index, chol(M + jitter), G, chol(G))`` of one block."""
        chol_m, info = torch.linalg.cholesky_ex(m + torch.diag(self.jitter * m.diagonal()))
        if int(info):
            raise ValueError(
                f"CPAB prior covariance is not positive definite with jitter {self.jitter:g} "
                f"(length_scale {self.length_scale:g}, tessellation {self.basis.tess.shape}); increase jitter"
            )
        return index, chol_m, g, torch.linalg.cholesky(g)

    def _factors(self, dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
        key = (dtype, device)
        if key not in self._device_cache:
            self._device_cache[key] = [
                (block[0].to(device), *(t.to(device=device, dtype=dtype) for t in block[1:])) for block in self._blocks
            ]
        return self._device_cache[key]

    @property
    def covariance_theta(self) -> torch.Tensor:
        """``Sigma_theta = G^-1 (M + jitter) G^-1`` (``d x d`` dense float64). For inspection and tests: energy,
        sampling and (un)whitening use the blocks' Cholesky factors and never build it."""
        d = self.basis.d
        if d > _MAX_DENSE:
            raise ValueError(f"covariance_theta would be a dense {d} x {d} matrix; use energy/whiten/unwhiten instead")
        out = torch.zeros(d, d, dtype=torch.float64)
        for index, chol_m, _, chol_g in self._blocks:
            root = torch.cholesky_solve(chol_m, chol_g)  # G^-1 chol(M)
            out[index[:, None], index[None, :]] = root @ root.T
        return out

    def covariance_A(self) -> torch.Tensor:
        """The prior covariance of ``vec(A)`` in domain coordinates before projection (``D x D`` dense float64,
        ``K ⊗ J^-1 J^-T``; ``K ⊗ I`` for the unit box), for small tessellations (tests)."""
        tess = self.basis.tess
        size = tess.n_cells * tess.ndim * (tess.ndim + 1)
        if size > _MAX_DENSE:
            raise ValueError(f"covariance_A would be a dense {size} x {size} matrix; too large")
        centres = _normalised_centres(self.basis)
        kernel = self.variance * torch.exp(-torch.cdist(centres, centres).square() / (2 * self.length_scale**2))
        jac_inv = torch.linalg.inv(unit_box_jacobian(self.basis))
        return torch.kron(kernel, jac_inv @ jac_inv.T)

    def whiten(self, theta: torch.Tensor) -> torch.Tensor:
        """``z = L^-1 theta`` (``(..., d)``, theta's dtype and device; differentiable), ``Sigma_theta = L L^T`` with
        ``L = G^-1 chol(M)`` per block."""
        out = torch.zeros_like(self._check(theta))
        for index, chol_m, g, _ in self._factors(theta.dtype, theta.device):
            projected = (theta[..., index] @ g).unsqueeze(-1)  # G theta (G symmetric)
            z = torch.linalg.solve_triangular(chol_m, projected, upper=False).squeeze(-1)
            out = out.index_copy(-1, index, z)
        return out

    def unwhiten(self, z: torch.Tensor) -> torch.Tensor:
        """``theta = L z`` (``(..., d)``): the map to optimise through, since ``energy(unwhiten(z)) = 1/2 |z|^2``."""
        out = torch.zeros_like(self._check(z))
        for index, chol_m, _, chol_g in self._factors(z.dtype, z.device):
            theta = torch.cholesky_solve(chol_m @ z[..., index].unsqueeze(-1), chol_g).squeeze(-1)
            out = out.index_copy(-1, index, theta)
        return out

    def _check(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1:] != (self.basis.d,):
            raise ValueError(f"expected shape (..., {self.basis.d}), got {tuple(x.shape)}")
        return x

    def energy(self, theta: torch.Tensor) -> torch.Tensor:
        """``1/2 theta^T Sigma_theta^-1 theta``, shape ``(...,)`` for theta ``(..., d)``; differentiable."""
        return 0.5 * self.whiten(theta).square().sum(dim=-1)

    def marginal_std(self) -> torch.Tensor:
        """The prior standard deviation of each theta coordinate, ``sqrt(diag(Sigma_theta))`` (``(d,)`` float64)."""
        out = torch.zeros(self.basis.d, dtype=torch.float64)
        for index, chol_m, _, chol_g in self._blocks:
            out[index] = torch.cholesky_solve(chol_m, chol_g).square().sum(dim=1).sqrt()  # rows of G^-1 chol(M)
        return out

    def sample_theta(self, n: int | None = None, *, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
        """Draws from ``N(0, scale^2 Sigma_theta)``: ``(d,)`` or ``(n, d)`` float64 on the generator's device.
        The same generator state gives the same sample."""
        shape = (self.basis.d,) if n is None else (n, self.basis.d)
        z = torch.randn(shape, generator=generator, dtype=torch.float64, device=generator.device)
        return scale * self.unwhiten(z)


def vertex_index_grid(basis: CPABasis, index: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The vertices of the nodal coordinates ``index`` of ``basis`` (``basis.free_vertex[index]``) as a product of
    per-axis sets, where they are one: per axis (x, y, z), the sorted int64 corner indices (positions in box units,
    ``0 .. tess.shape[a]``) whose Cartesian product, x fastest (the order of vertex ids), is those vertices in the order
    of ``index``. None in 2D (the rectangle centres are not on the corner lattice) and for sets that are no such
    product. Where it is one, :class:`VertexPrior` factors its kernel axis by axis."""
    tess = basis.tess
    if tess.ndim != 3:
        return None
    ids = basis.free_vertex[index]
    counts = [s + 1 for s in tess.shape]
    coords = [ids % counts[0], (ids // counts[0]) % counts[1], ids // (counts[0] * counts[1])]
    axes = tuple(torch.unique(c) for c in coords)
    if math.prod(a.numel() for a in axes) != ids.numel():
        return None
    grid = torch.cartesian_prod(*reversed(axes))  # rows (z, y, x), x fastest: the order of sorted vertex ids
    expected = grid[:, 2] + counts[0] * (grid[:, 1] + counts[1] * grid[:, 0])
    return axes if torch.equal(expected, ids) else None


def _symmetric_roots(kernel: torch.Tensor, jitter: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K + jitter I)^(1/2)`` and its inverse, for a symmetric positive semi-definite ``K`` (float64)."""
    values, vectors = torch.linalg.eigh(kernel)
    values = values.clamp_min(0.0) + jitter
    return (vectors * values.sqrt()) @ vectors.T, (vectors * values.rsqrt()) @ vectors.T


class VertexPrior:
    """Gaussian prior on the vertex velocities: a squared-exponential Gaussian process per velocity component.

    Definition. In the unit box (``u = (x - lower) / (upper - lower)``, velocities in box extents per unit time,
    as :class:`CPABPrior`), every free velocity component ``v_a`` at the tessellation's vertices is Gaussian with

        Cov[v_a(u), v_b(u')] = [a == b] variance length_scale^2 (k(u, u') + jitter [u == u'])

    with ``k(u, u') = exp(-|u - u'|^2 / (2 length_scale^2))``. The amplitude ``variance length_scale^2`` gives the
    velocity's spatial derivatives the variance ``variance`` (``-d^2 k / du^2 = 1 / length_scale^2`` at 0), which is
    how :class:`CPABPrior` scales the linear parts of the normalised cell maps; its marginal vertex-velocity variance
    is close (0.0065 in 3D, 0.0115 in 2D at ``length_scale`` 0.1, against 0.01 here). Components the boundary mode
    fixes are not parameters. For nodal bases (no volume preservation) only.

    Computation. In 3D the free vertices of every component are a product of per-axis index sets, so ``k`` on them
    is the Kronecker product of three 1D kernels; with ``jitter`` added to each 1D factor, the whitening map is the
    Kronecker product of their symmetric square roots: ``theta = W^-1 (R_z ⊗ R_y ⊗ R_x) z`` (``W`` the unit-box
    velocity per theta coordinate), applied axis by axis in ``O(V (n_x + n_y + n_z))`` per component, with memory
    ``O(n_x^2 + n_y^2 + n_z^2)``. Other vertex sets (the 2D centres) use the dense symmetric root of the ``V x V``
    kernel (``O(V^3)`` once, ``O(V^2)`` per call). The symmetric root makes each whitened coordinate a smooth bump
    centred on its vertex. ``energy(theta) = 1/2 |whiten(theta)|^2``.
    """

    def __init__(self, basis: CPABasis, length_scale: float = 0.1, variance: float = 1.0, *, jitter: float = 1e-6):
        _check_hyperparameters(length_scale, variance, jitter)
        if basis.reduction is not None:
            raise ValueError("VertexPrior needs a nodal basis (no volume preservation); use CPABPrior")
        self.basis = basis
        self.length_scale = float(length_scale)
        self.variance = float(variance)
        self.jitter = float(jitter)
        tess = basis.tess
        extent = torch.tensor(tess.upper, dtype=torch.float64) - torch.tensor(tess.lower, dtype=torch.float64)
        vertices = tess.vertices_in_box_units() / torch.tensor(tess.shape, dtype=torch.float64)  # in the unit box
        amplitude = math.sqrt(self.variance) * self.length_scale
        # per block: (index, theta per unit velocity (k,), root factors, inverse root factors); factors are
        # [(R_x, R_y, R_z)] for the Kronecker form or [R] dense
        self._blocks: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []
        for axis in range(tess.ndim):
            index = torch.nonzero(basis.free_axis == axis).flatten()
            if not index.numel():
                continue
            per_theta = basis.scale[index] / extent[axis]  # unit-box velocity per theta_i
            grid = vertex_index_grid(basis, index)
            if grid is None:
                points = vertices[basis.free_vertex[index]]
                roots = [_symmetric_roots(self._kernel(points), self.jitter)]
            else:
                roots = [
                    _symmetric_roots(self._kernel(positions.double()[:, None] / cells), self.jitter)
                    for positions, cells in zip(grid, tess.shape, strict=True)
                ]
            self._blocks.append((index, amplitude / per_theta, [r for r, _ in roots], [r_inv for _, r_inv in roots]))
        self._device_cache: dict[tuple[torch.dtype, torch.device], list[tuple]] = {}

    @property
    def factor_sizes(self) -> list[tuple[int, ...]]:
        """Per velocity component that has parameters, the sides of its whitening factors (class docstring):
        ``(n_x, n_y, n_z)`` for the Kronecker form (3D), ``(V,)`` for a dense ``V x V`` root (2D, and vertex sets that
        are no product of per-axis sets). Memory grows with the sum of their squares."""
        return [tuple(int(f.shape[0]) for f in roots) for _, _, roots, _ in self._blocks]

    def _kernel(self, points: torch.Tensor) -> torch.Tensor:
        return torch.exp(-torch.cdist(points, points).square() / (2 * self.length_scale**2))

    def _factors(self, dtype: torch.dtype, device: torch.device) -> list[tuple]:
        key = (dtype, device)
        if key not in self._device_cache:
            self._device_cache[key] = [
                (
                    index.to(device),
                    weight.to(device=device, dtype=dtype),
                    [f.to(device=device, dtype=dtype) for f in roots],
                    [f.to(device=device, dtype=dtype) for f in inverses],
                )
                for index, weight, roots, inverses in self._blocks
            ]
        return self._device_cache[key]

    @staticmethod
    def _apply(factors: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``(F_z ⊗ F_y ⊗ F_x) x`` for factors ``[F_x, F_y, F_z]`` (x fastest in ``x``'s last axis), or ``F x``."""
        if len(factors) == 1:
            return x @ factors[0].T
        fx, fy, fz = factors
        grid = x.unflatten(-1, (fz.shape[0], fy.shape[0], fx.shape[0]))
        grid = torch.einsum("...zyx,ax->...zya", grid, fx)
        grid = torch.einsum("...zyx,ay->...zax", grid, fy)
        grid = torch.einsum("...zyx,az->...ayx", grid, fz)
        return grid.flatten(-3)

    def _check(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1:] != (self.basis.d,):
            raise ValueError(f"expected shape (..., {self.basis.d}), got {tuple(x.shape)}")
        return x

    def unwhiten(self, z: torch.Tensor) -> torch.Tensor:
        """``theta = L z`` (``(..., d)``, z's dtype and device; differentiable), ``Sigma_theta = L L^T``, ``L``
        symmetric in velocity units (class docstring)."""
        out = torch.zeros_like(self._check(z))
        for index, weight, roots, _ in self._factors(z.dtype, z.device):
            out = out.index_copy(-1, index, weight * self._apply(roots, z[..., index]))
        return out

    def whiten(self, theta: torch.Tensor) -> torch.Tensor:
        """``z = L^-1 theta`` (``(..., d)``; differentiable): the inverse of :meth:`unwhiten`."""
        out = torch.zeros_like(self._check(theta))
        for index, weight, _, inverses in self._factors(theta.dtype, theta.device):
            out = out.index_copy(-1, index, self._apply(inverses, theta[..., index] / weight))
        return out

    def energy(self, theta: torch.Tensor) -> torch.Tensor:
        """``1/2 theta^T Sigma_theta^-1 theta``, shape ``(...,)`` for theta ``(..., d)``; differentiable."""
        return 0.5 * self.whiten(theta).square().sum(dim=-1)

    @property
    def covariance_theta(self) -> torch.Tensor:
        """``Sigma_theta = L L^T`` (``d x d`` dense float64), for inspection and tests."""
        d = self.basis.d
        if d > _MAX_DENSE:
            raise ValueError(f"covariance_theta would be a dense {d} x {d} matrix; use energy/whiten/unwhiten instead")
        root = self.unwhiten(torch.eye(d, dtype=torch.float64)).T
        return root @ root.T

    def marginal_std(self) -> torch.Tensor:
        """The prior standard deviation of each theta coordinate, ``sqrt(diag(Sigma_theta))`` (``(d,)`` float64)."""
        out = torch.zeros(self.basis.d, dtype=torch.float64)
        for index, weight, roots, _ in self._blocks:
            diagonal = roots[0].square().sum(dim=1)
            for factor in roots[1:]:  # diag(A ⊗ B) = diag(A) ⊗ diag(B), x fastest
                diagonal = (factor.square().sum(dim=1)[:, None] * diagonal[None, :]).flatten()
            out[index] = weight.abs() * diagonal.sqrt()
        return out

    def sample_theta(self, n: int | None = None, *, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
        """Draws from ``N(0, scale^2 Sigma_theta)``: ``(d,)`` or ``(n, d)`` float64 on the generator's device."""
        shape = (self.basis.d,) if n is None else (n, self.basis.d)
        z = torch.randn(shape, generator=generator, dtype=torch.float64, device=generator.device)
        return scale * self.unwhiten(z)
