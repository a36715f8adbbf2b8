"""Continuous piecewise-affine velocity fields on a tessellation: constraints and a sparse basis.

On cell ``c`` the velocity is ``v(x) = A_c [x; 1]`` with ``A_c`` of shape ``(n, n + 1)`` and ``x`` in *domain*
coordinates (the tessellation's box ``[lower, upper]``, (x, y[, z]) order). ``vec(A)`` flattens the ``(C, n, n + 1)``
tensor row-major, so ``D = C n (n + 1)`` and entry ``(c, a, m)`` sits at ``c n (n + 1) + a (n + 1) + m``.

The admissible fields are the null space of the constraint matrix ``L`` (``constraint_matrix``): continuity across
shared facets, a boundary condition, and optionally zero divergence (``trace A_c = 0``). A continuous piecewise-affine
field on this conforming simplicial mesh is fixed by its velocities at the mesh vertices, so the basis is *nodal*:
theta holds the free vertex-velocity components, each divided by the norm of its column of ``B`` (so that
``vec(A) = B theta`` with unit-norm columns). Free components, and ``d`` (``nx, ny[, nz]`` cells per axis):

* ``"zero"`` (FG-CPAB): the velocity vanishes on the boundary; all components of the interior vertices are free.
  2D: ``d = 2 [(nx - 1)(ny - 1) + nx ny]`` (rectangle centres are interior vertices).
  3D: ``d = 3 (nx - 1)(ny - 1)(nz - 1)``.
* ``"normal"`` (libcpab): only the normal component vanishes on each boundary face; component ``a`` of a vertex is
  free unless the vertex lies on a face normal to axis ``a`` (so face vertices keep their tangential components,
  3D edge vertices the one along the edge, corners none). ``d = sum_a (n_a - 1) prod_{b != a} (n_b + 1)``
  ``(+ 2 nx ny`` in 2D for the centres``)``, i.e. 2D: ``d = 2 [(nx - 1)(ny - 1) + nx ny] + 2 (nx - 1) + 2 (ny - 1)``,
  3D: ``d = (nx - 1)(ny + 1)(nz + 1) + (nx + 1)(ny - 1)(nz + 1) + (nx + 1)(ny + 1)(nz - 1)``.
* ``"free"``: no boundary condition; every component of every vertex is free.
  2D: ``d = 2 [(nx + 1)(ny + 1) + nx ny]``; 3D: ``d = 3 (nx + 1)(ny + 1)(nz + 1)``.

Nodal coordinates are ordered vertex-major: vertex id ascending, then component x, y[, z].

Volume preservation adds ``C`` trace constraints that vertex values do not satisfy by themselves. The basis is then
``B = B_nodal R`` with ``R`` (``d_nodal x d``) an orthonormal basis of the null space of the sparse ``C x d_nodal``
trace system ``K``, from a dense eigendecomposition of ``K^T K``, its columns rescaled so that ``B``'s columns have
unit norm. ``R`` and hence ``B`` are dense (not local). Cost ``O(d_nodal^3)`` time, ``O(d_nodal (C + d_nodal))``
memory; measured on one CPU thread: 2D 16 x 16 0.4 s, 24 x 24 3.7 s, 32 x 32 ~20 s (1.7 s on 16 cores); 3D 8^3
0.5 s. Beyond
``_MAX_VOLUME_PRESERVING_NODAL`` free components (2D ~45 x 45, 3D ``zero`` ~14^3) it raises ``ValueError``.
Continuous piecewise-linear divergence-free fields lock, so ``d`` is far smaller than ``d_nodal`` (computed, and
tested on the shapes listed):

* 2D: ``zero`` ``d = max(nx - 2, 0) max(ny - 2, 0)``; ``normal`` ``d = nx ny - 1``;
  ``free`` ``d = (nx + 2)(ny + 2) - 2``.
* 3D: ``zero`` ``d = 0`` on every mesh tried (up to 8^3): no volume-preserving field exists.
  ``normal``: 2^3: 3, 3^3: 11, 4^3: 20, 6^3: 49, 8^3: 90, 2 x 3 x 4: 2, 3 x 4 x 5: 0.
  ``free``: 1^3: 19, 2^3: 45, 3^3: 85, 6^3: 273, 2 x 3 x 4: 83 (no closed form found; parity dependent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from regkit._backend import BackendError, load_kernels, resolve_backend
from regkit.cpab.tessellation import Tessellation

_TO_A_FACES = ("torch", "triton")  # the basis map: PyTorch, or one fused Triton kernel each way (CUDA)

BOUNDARY_MODES = ("zero", "normal", "free")

# Largest nodal dimension for which the dense volume-preserving null-space step is attempted (a ~0.5 GB SVD).
_MAX_VOLUME_PRESERVING_NODAL = 8000
# Relative singular-value threshold below which a direction counts as a null direction (SVD of L).
_NULL_TOL = 1e-9
# The same for eigenvalues of K^T K (singular values below 1e-5 relative). On these meshes the null eigenvalues sit
# at ~1e-15 and the smallest non-null ones at >= 1e-4 (measured up to 2D 32 x 32 and 3D 8^3).
_GRAM_NULL_TOL = 1e-10


def _check_boundary(boundary: str) -> None:
    if boundary not in BOUNDARY_MODES:
        raise ValueError(f"unknown CPAB boundary mode {boundary!r}; expected one of {', '.join(BOUNDARY_MODES)}")


def cell_inverses(tess: Tessellation, normalised: bool = False) -> np.ndarray:
    """(C, n + 1, n + 1) float64 ``inv(M_c)`` for every cell ``c`` of ``tess``: ``M_c`` is the matrix whose column
    ``k`` is ``[p_k; 1]``, ``p_k`` the cell's ``k``-th vertex (the order of ``tess.cell_vertex_ids()``) in domain
    coordinates, (x, y[, z]) order. The affine field that takes the velocities ``V_c`` (column ``k`` at ``p_k``) at the
    cell's vertices is ``A_c = V_c inv(M_c)``, so ``A_c [x; 1]`` interpolates them at ``x``.

    With ``normalised`` the vertices are taken in the unit box instead (``(p - lower) / (upper - lower)``).
    """
    verts = tess.cell_vertices().numpy()
    if normalised:
        lower, upper = np.asarray(tess.lower), np.asarray(tess.upper)
        verts = (verts - lower) / (upper - lower)
    ones = np.ones((*verts.shape[:-1], 1))
    return np.linalg.inv(np.concatenate([verts, ones], axis=-1).transpose(0, 2, 1))


def _free_components(tess: Tessellation, boundary: str) -> np.ndarray:
    """(V, n) bool: which vertex-velocity components are free parameters under the boundary mode."""
    grid = tess.vertices_in_box_units().numpy()
    interior = (grid > 0) & (grid < np.asarray(tess.shape, dtype=np.float64))
    if boundary == "zero":
        return np.repeat(interior.all(axis=1, keepdims=True), tess.ndim, axis=1)
    if boundary == "normal":
        return interior
    return np.ones_like(interior)


def _vec_index(cells: np.ndarray, axis: np.ndarray | int, slot: np.ndarray | int, n: int) -> np.ndarray:
    """Position of ``A[cells, axis, slot]`` in ``vec(A)``."""
    return (cells * n + axis) * (n + 1) + slot


def _sparse(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    index = torch.from_numpy(np.stack([rows.ravel(), cols.ravel()]).astype(np.int64))
    matrix = torch.sparse_coo_tensor(
        index, torch.from_numpy(vals.ravel().astype(np.float64)), shape, check_invariants=True
    )
    return matrix.coalesce()


def constraint_matrix(tess: Tessellation, boundary: str = "zero", volume_preserving: bool = False) -> torch.Tensor:
    """The constraint matrix ``L`` (sparse COO float64, ``(rows, D)``) with ``L vec(A) = 0`` for admissible fields.

    Rows: for every interior facet, every vertex ``p`` on it and every component, ``A_c1 [p; 1] - A_c2 [p; 1]``
    (continuity); for every boundary facet and vertex, ``A_c [p; 1]`` (``"zero"``: every component; ``"normal"``: the
    one along the facet's normal; ``"free"``: none); with ``volume_preserving``, ``trace(A_c[:, :n])`` per cell.
    Rows are not deduplicated (``L`` is rank deficient).
    """
    _check_boundary(boundary)
    n, n_cells = tess.ndim, tess.n_cells
    verts = tess.vertices().numpy()
    homog = np.concatenate([verts, np.ones((len(verts), 1))], axis=1)  # (V, n + 1)
    slots = np.arange(n + 1)
    rows, cols, vals = [], [], []
    n_rows = 0

    def add(cells: np.ndarray, sign: float, point_ids: np.ndarray, axes: np.ndarray, row_ids: np.ndarray) -> None:
        """Entries ``sign * A[cells, axes, :] @ [p; 1]`` in rows ``row_ids``; all arrays of one shape (R,)."""
        rows.append(np.repeat(row_ids, n + 1))
        cols.append(_vec_index(cells[:, None], axes[:, None], slots[None, :], n).ravel())
        vals.append((sign * homog[point_ids]).ravel())

    pairs, shared = (t.numpy() for t in tess.facets())
    axes = np.arange(n)
    # one row per (facet, facet vertex, component)
    facet_idx, vert_slot, axis = (g.ravel() for g in np.meshgrid(np.arange(len(pairs)), axes, axes, indexing="ij"))
    point_ids = shared[facet_idx, vert_slot]
    row_ids = np.arange(len(facet_idx)) + n_rows
    add(pairs[facet_idx, 0], 1.0, point_ids, axis, row_ids)
    add(pairs[facet_idx, 1], -1.0, point_ids, axis, row_ids)
    n_rows += len(row_ids)

    if boundary != "free":
        cells, bverts, normals = (t.numpy() for t in tess.boundary_facets())
        facet_idx, vert_slot, axis = (g.ravel() for g in np.meshgrid(np.arange(len(cells)), axes, axes, indexing="ij"))
        if boundary == "normal":
            keep = normals[facet_idx, axis] != 0
            facet_idx, vert_slot, axis = facet_idx[keep], vert_slot[keep], axis[keep]
        row_ids = np.arange(len(facet_idx)) + n_rows
        add(cells[facet_idx], 1.0, bverts[facet_idx, vert_slot], axis, row_ids)
        n_rows += len(row_ids)

    if volume_preserving:
        cell_ids = np.repeat(np.arange(n_cells), n)
        diag = np.tile(axes, n_cells)
        rows.append(cell_ids + n_rows)
        cols.append(_vec_index(cell_ids, diag, diag, n))
        vals.append(np.ones(len(cell_ids)))
        n_rows += n_cells

    shape = (n_rows, n_cells * n * (n + 1))
    return _sparse(np.concatenate(rows), np.concatenate(cols), np.concatenate(vals), shape)


def _null_space(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis (columns, float64) of the null space of a dense matrix, by SVD."""
    rows, cols = matrix.shape
    if rows == 0:
        return torch.eye(cols, dtype=torch.float64)
    _, s, vh = torch.linalg.svd(matrix, full_matrices=rows < cols)
    rank = int((s > _NULL_TOL * s.max()).sum())
    return vh[rank:].T.contiguous()


def _null_space_sparse(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis (columns, float64) of the null space of a sparse COO matrix ``K`` (rows, cols), from the
    eigenvectors of the dense ``cols x cols`` Gram matrix ``K^T K`` (cheaper than an SVD of ``K``; the squared
    threshold is safe because these systems' spectra have a wide gap, see ``_GRAM_NULL_TOL``)."""
    gram = torch.sparse.mm(matrix.t().coalesce(), matrix.to_dense())
    if gram.shape[0] == 0:
        return gram
    eigval, eigvec = torch.linalg.eigh(gram)
    return eigvec[:, eigval <= _GRAM_NULL_TOL * eigval[-1]].contiguous()


def dense_svd_basis(tess: Tessellation, boundary: str = "zero", volume_preserving: bool = False) -> torch.Tensor:
    """(D, d) dense float64 orthonormal basis of the null space of ``constraint_matrix`` by SVD.

    A cross-check for small tessellations only (it densifies ``L``, ``O(D^3)``).
    """
    return _null_space(constraint_matrix(tess, boundary, volume_preserving).to_dense())


@dataclass(frozen=True, eq=False)
class CPABasis:
    """A basis ``B`` of the admissible ``vec(A)``, stored in nodal form (module docstring).

    ``vec(A) = B theta`` with ``B = B_nodal R`` (``R`` = identity unless ``volume_preserving``), where ``B_nodal``
    maps nodal coordinate ``i`` to velocity ``scale[i]`` in component ``free_axis[i]`` at vertex ``free_vertex[i]``
    (every other free component zero) and interpolates affinely on each cell. Build with ``cpa_basis``.
    """

    tess: Tessellation
    boundary: str
    volume_preserving: bool
    free_vertex: torch.Tensor  # (d_nodal,) int64 vertex id of each nodal coordinate
    free_axis: torch.Tensor  # (d_nodal,) int64 velocity component of each nodal coordinate
    scale: torch.Tensor  # (d_nodal,) float64 vertex velocity per unit nodal coordinate (1 / column norm of B_nodal)
    cell_inverse: torch.Tensor  # (C, n + 1, n + 1) float64 inv(M_c), see cell_inverses
    reduction: torch.Tensor | None  # (d_nodal, d) float64 R, or None (identity)
    _device_cache: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def d(self) -> int:
        """Number of parameters (length of theta)."""
        return self.d_nodal if self.reduction is None else self.reduction.shape[1]

    @property
    def d_nodal(self) -> int:
        """Number of free vertex-velocity components."""
        return self.free_vertex.numel()

    @cached_property
    def nodal_matrix(self) -> torch.Tensor:
        """``B_nodal``, sparse COO float64 ``(D, d_nodal)`` with unit-norm columns."""
        n = self.tess.ndim
        ids = self.tess.cell_vertex_ids().numpy()
        column = np.full(self.tess.n_vertices * n, -1, dtype=np.int64)
        column[(self.free_vertex * n + self.free_axis).numpy()] = np.arange(self.d_nodal)
        cells, k, axis, slot = np.meshgrid(*(np.arange(s) for s in (self.tess.n_cells, n + 1, n, n + 1)), indexing="ij")
        cols = column[ids[cells, k] * n + axis]
        keep = cols >= 0
        cells, k, axis, slot, cols = cells[keep], k[keep], axis[keep], slot[keep], cols[keep]
        vals = self.cell_inverse.numpy()[cells, k, slot] * self.scale.numpy()[cols]
        shape = (self.tess.n_cells * n * (n + 1), self.d_nodal)
        return _sparse(_vec_index(cells, axis, slot, n), cols, vals, shape)

    @cached_property
    def matrix(self) -> torch.Tensor:
        """``B``, sparse COO float64 ``(D, d)`` with unit-norm columns: ``vec(A) = B theta``.

        With ``volume_preserving`` it is dense in content (``D d`` entries); ``to_A``/``project`` never build it.
        """
        if self.reduction is None:
            return self.nodal_matrix
        return torch.sparse.mm(self.nodal_matrix, self.reduction).to_sparse().coalesce()

    def _factors(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(flat free index, scale, cell vertex ids, cell inverses, reduction) in ``dtype`` on ``device``, cached."""
        key = (dtype, device)
        if key not in self._device_cache:
            n = self.tess.ndim
            flat = (self.free_vertex * n + self.free_axis).to(device)
            ids = self.tess.cell_vertex_ids().to(device)
            reduction = None if self.reduction is None else self.reduction.to(device=device, dtype=dtype)
            self._device_cache[key] = (
                flat,
                self.scale.to(device=device, dtype=dtype),
                ids,
                self.cell_inverse.to(device=device, dtype=dtype),
                reduction,
            )
        return self._device_cache[key]

    def _check_theta(self, theta: torch.Tensor) -> None:
        if theta.shape[-1:] != (self.d,) or theta.dim() > 2:
            raise ValueError(f"theta must have shape ({self.d},) or (B, {self.d}), got {tuple(theta.shape)}")

    def vertex_velocities(self, theta: torch.Tensor) -> torch.Tensor:
        """Velocities ``(..., V, n)`` at ``tess.vertices()`` for theta ``(..., d)`` (domain units per unit time)."""
        flat, scale, _, _, reduction = self._factors(theta.dtype, theta.device)
        nodal = theta if reduction is None else theta @ reduction.T
        n = self.tess.ndim
        vel = nodal.new_zeros((*nodal.shape[:-1], self.tess.n_vertices * n))
        vel = vel.index_copy(-1, flat, nodal * scale)
        return vel.unflatten(-1, (self.tess.n_vertices, n))

    def fit_vertex_velocities(self, velocities: torch.Tensor) -> torch.Tensor:
        """theta ``(..., d)`` whose field takes the given velocities ``(..., V, n)`` at ``tess.vertices()``.

        The inverse of :meth:`vertex_velocities` on admissible fields: the free components are read off (components
        the boundary mode fixes are ignored); with volume preservation, the least-squares fit in the nodal
        coordinates. Used to carry a coarse solution to a finer tessellation: evaluate the coarse field at the fine
        vertices, then fit (exact when the coarse field is continuous piecewise affine on the fine cells).
        """
        flat, scale, _, _, reduction = self._factors(velocities.dtype, velocities.device)
        nodal = velocities.flatten(-2)[..., flat] / scale
        if reduction is None:
            return nodal
        return torch.linalg.lstsq(reduction, nodal.unsqueeze(-1)).solution.squeeze(-1)

    def to_A(self, theta: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """Per-cell affine maps ``(C, n, n + 1)`` (or ``(B, C, n, n + 1)``) for theta ``(d,)`` (or ``(B, d)``).

        Equals ``B @ theta`` reshaped; same dtype and device as theta; differentiable. ``backend``: ``"torch"`` (the
        nodal form: gather the cells' corner velocities, one ``einsum``), ``"triton"`` (``regkit_kernels.cpab``'s
        ``cell_velocities``: one kernel each way; not for volume-preserving bases) or ``"auto"`` (triton for CUDA
        tensors where it applies and its kernels import, else torch).
        """
        self._check_theta(theta)
        if self.reduction is not None and backend == "triton":
            raise BackendError("backend 'triton' of the basis map does not support volume-preserving bases")
        if self.reduction is None and resolve_backend(backend, theta.device, "cpab", faces=_TO_A_FACES) == "triton":
            return load_kernels("cpab").cell_velocities(self, theta)
        _, _, ids, inverse, _ = self._factors(theta.dtype, theta.device)
        corner_velocities = self.vertex_velocities(theta)[..., ids, :]  # (..., C, n + 1, n)
        return torch.einsum("...cka,ckm->...cam", corner_velocities, inverse)

    def project(self, grad_A: torch.Tensor) -> torch.Tensor:
        """``B^T vec(grad_A)``: ``(..., C, n, n + 1)`` -> ``(..., d)``, the adjoint of ``to_A``."""
        n, n_cells = self.tess.ndim, self.tess.n_cells
        if grad_A.shape[-3:] != (n_cells, n, n + 1):
            raise ValueError(f"grad_A must have shape (..., {n_cells}, {n}, {n + 1}), got {tuple(grad_A.shape)}")
        flat, scale, ids, inverse, reduction = self._factors(grad_A.dtype, grad_A.device)
        per_corner = torch.einsum("...cam,ckm->...cka", grad_A, inverse).flatten(-3, -2)  # (..., C (n + 1), n)
        batch = grad_A.shape[:-3]
        vel = grad_A.new_zeros((*batch, self.tess.n_vertices, n)).index_add(-2, ids.flatten(), per_corner)
        nodal = vel.flatten(-2)[..., flat] * scale
        return nodal if reduction is None else nodal @ reduction

    def velocity(self, theta: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
        """Velocity ``(..., n)`` at domain points ``(..., n)`` (outside points: their projection's cell, as
        ``Tessellation.locate``). theta ``(d,)`` with any points, or ``(B, d)`` with points ``(B, ..., n)``."""
        A = self.to_A(theta)
        cells = self.tess.locate(points)
        if theta.dim() == 2:
            if points.dim() < 2 or points.shape[0] != theta.shape[0]:
                raise ValueError(
                    f"with theta {tuple(theta.shape)}, points must be (B, ..., n), got {tuple(points.shape)}"
                )
            batch = torch.arange(theta.shape[0], device=points.device).view(-1, *[1] * (cells.dim() - 1))
            A = A[batch, cells]
        else:
            A = A[cells]
        return (A[..., :-1] @ points.to(A.dtype).unsqueeze(-1)).squeeze(-1) + A[..., -1]


def cpa_basis(tess: Tessellation, boundary: str = "zero", volume_preserving: bool = False) -> CPABasis:
    """The nodal CPA basis of ``tess`` for a boundary mode (module docstring), built sparsely.

    Without volume preservation the cost is linear in the number of cells. ``d`` may be 0 (e.g. 3D ``"zero"`` with
    a single cube, or volume preservation on coarse 3D meshes).
    """
    _check_boundary(boundary)
    n = tess.ndim
    free_vertex, free_axis = np.nonzero(_free_components(tess, boundary))
    inverse = cell_inverses(tess)
    norm_sq = np.zeros(tess.n_vertices)
    np.add.at(norm_sq, tess.cell_vertex_ids().numpy().ravel(), (inverse**2).sum(axis=-1).ravel())
    scale = 1.0 / np.sqrt(norm_sq[free_vertex])
    basis = CPABasis(
        tess=tess,
        boundary=boundary,
        volume_preserving=False,
        free_vertex=torch.from_numpy(free_vertex.astype(np.int64)),
        free_axis=torch.from_numpy(free_axis.astype(np.int64)),
        scale=torch.from_numpy(scale),
        cell_inverse=torch.from_numpy(inverse),
        reduction=None,
    )
    if not volume_preserving:
        return basis
    if basis.d_nodal > _MAX_VOLUME_PRESERVING_NODAL:
        raise ValueError(
            f"volume preservation needs a dense null space of a {tess.n_cells} x {basis.d_nodal} system; "
            f"tessellation {tess.shape} is too fine (at most {_MAX_VOLUME_PRESERVING_NODAL} free vertex components)"
        )
    # the trace system: row c sums the rows (c, a, a) of B_nodal
    index, values = basis.nodal_matrix.indices().numpy(), basis.nodal_matrix.values().numpy()
    cell, entry = np.divmod(index[0], n * (n + 1))
    on_diagonal = entry % (n + 2) == 0  # entry a (n + 1) + a
    system = _sparse(cell[on_diagonal], index[1][on_diagonal], values[on_diagonal], (tess.n_cells, basis.d_nodal))
    reduction = _null_space_sparse(system)
    reduction = reduction / torch.sparse.mm(basis.nodal_matrix, reduction).norm(dim=0)
    return CPABasis(
        tess=tess,
        boundary=boundary,
        volume_preserving=True,
        free_vertex=basis.free_vertex,
        free_axis=basis.free_axis,
        scale=basis.scale,
        cell_inverse=basis.cell_inverse,
        reduction=reduction,
    )
