"""The CPAB tessellation: a box split into rectangles (2D) or cubes (3D), each split into simplices.

Coordinates. Every point and vertex is in *domain* coordinates, in (x, y[, z]) order: the box
``[lower, upper]`` (the unit box by default). Boxes are numbered ``b = i + nx * (j + ny * k)`` with ``i`` along x, and
cells ``c = cells_per_box * b + local``.

2D (4 triangles per rectangle, around its centre, which is an extra mesh vertex). ``local``:
``0`` = the triangle on the rectangle's y-low edge, ``1`` = x-high edge, ``2`` = y-high edge, ``3`` = x-low edge.
Vertices: the ``(nx + 1)(ny + 1)`` rectangle corners (id ``i + (nx + 1) j``), then the ``nx ny`` centres (id
``(nx + 1)(ny + 1) + b``). Each triangle lists its vertices counter-clockwise, centre first.

3D (5 tetrahedra per cube; vertices are the ``(nx + 1)(ny + 1)(nz + 1)`` cube corners only, id
``i + (nx + 1)(j + (ny + 1) k)``). In cube ``(i, j, k)`` the central tetrahedron (``local = 0``) joins the four corners
whose global index sum ``i + j + k + a + b + c`` is even; ``local = 1, 2, 3, 4`` are the corner tetrahedra cut off at
the other four corners, which in an even cube (``i + j + k`` even) are the local corners (1,0,0), (0,1,0), (0,0,1),
(1,1,1), and in an odd cube their mirror images in x: (0,0,0), (1,1,0), (1,0,1), (0,1,1). Every face diagonal thus
joins the two even-sum corners of its square, so neighbouring cubes' faces conform. Tetrahedra are listed with
positive orientation.

Points outside the box (``locate``): a point gets the cell of its projection onto the box (each coordinate clamped to
``[lower, upper]``); integration applies that cell's affine field to the unclamped point. Points on facets shared by
several cells get one of them, deterministically; it always contains the point (up to rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from regkit._backend import device_constant

# 2D: per local triangle, its vertices as (a, b) rectangle-corner offsets; the centre comes first and is not listed.
_TRI_CORNERS = np.array(
    [
        [[0, 0], [1, 0]],  # 0: y-low edge
        [[1, 0], [1, 1]],  # 1: x-high edge
        [[1, 1], [0, 1]],  # 2: y-high edge
        [[0, 1], [0, 0]],  # 3: x-low edge
    ]
)


def _tet_corners() -> np.ndarray:
    """(2, 5, 4, 3) local cube-corner offsets of the 5 tetrahedra, for even and odd cubes, positively oriented."""
    even = np.array(
        [
            [[0, 0, 0], [1, 1, 0], [1, 0, 1], [0, 1, 1]],  # 0: central
            [[1, 0, 0], [0, 0, 0], [1, 1, 0], [1, 0, 1]],  # 1
            [[0, 1, 0], [0, 0, 0], [1, 1, 0], [0, 1, 1]],  # 2
            [[0, 0, 1], [0, 0, 0], [1, 0, 1], [0, 1, 1]],  # 3
            [[1, 1, 1], [1, 1, 0], [1, 0, 1], [0, 1, 1]],  # 4
        ]
    )
    odd = even.copy()
    odd[..., 0] = 1 - odd[..., 0]
    tables = np.stack([even, odd])
    edges = tables[..., 1:, :] - tables[..., :1, :]
    negative = np.linalg.det(edges.astype(np.float64)) < 0
    tables[negative] = tables[negative][:, [0, 1, 3, 2]]
    return tables


_TET_CORNERS = _tet_corners()


def _facet_key(ids: np.ndarray, base: int) -> np.ndarray:
    """One int64 key per row of sorted vertex ids (..., m), unique for ids < base."""
    key = np.zeros(ids.shape[:-1], dtype=np.int64)
    for col in range(ids.shape[-1]):
        key = key * base + ids[..., col]
    return key


@dataclass(frozen=True)
class Tessellation:
    """A box ``[lower, upper]`` split into ``shape`` boxes per axis, each split into simplices (module docstring).

    ``shape`` is in (x, y[, z]) order, each entry >= 1. ``lower``/``upper`` default to zeros/ones.
    """

    shape: tuple[int, ...]
    lower: tuple[float, ...] | None = None
    upper: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if len(shape) not in (2, 3):
            raise ValueError(f"a tessellation must be 2D or 3D, got shape {shape}")
        if any(isinstance(s, bool) or int(s) != s or int(s) < 1 for s in shape):
            raise ValueError(f"tessellation shape must be positive integers, got {shape}")
        n = len(shape)
        lower = (0.0,) * n if self.lower is None else tuple(float(v) for v in self.lower)
        upper = (1.0,) * n if self.upper is None else tuple(float(v) for v in self.upper)
        if len(lower) != n or len(upper) != n:
            raise ValueError(f"tessellation bounds must have {n} entries, got lower {lower}, upper {upper}")
        if not all(math.isfinite(v) for v in lower + upper) or any(
            lo >= up for lo, up in zip(lower, upper, strict=True)
        ):
            raise ValueError(f"tessellation bounds must be finite with lower < upper, got lower {lower}, upper {upper}")
        object.__setattr__(self, "shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "lower", lower)
        object.__setattr__(self, "upper", upper)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def cells_per_box(self) -> int:
        """4 triangles per rectangle in 2D, 5 tetrahedra per cube in 3D."""
        return 4 if self.ndim == 2 else 5

    @property
    def n_boxes(self) -> int:
        return math.prod(self.shape)

    @property
    def n_cells(self) -> int:
        return self.cells_per_box * self.n_boxes

    @property
    def n_vertices(self) -> int:
        corners = math.prod(s + 1 for s in self.shape)
        return corners + (self.n_boxes if self.ndim == 2 else 0)

    # ---- mesh (numpy, cached; the public methods return fresh tensors) ----

    @cached_property
    def _grid_vertices(self) -> np.ndarray:
        """(V, ndim) float64 vertex positions in box units: corners at integers, 2D centres at half-integers."""
        axes = [np.arange(s + 1, dtype=np.float64) for s in self.shape]
        corners = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1)  # (nx+1, ny+1[, nz+1], n), i fastest below
        corners = corners.transpose(*reversed(range(self.ndim)), self.ndim).reshape(-1, self.ndim)
        if self.ndim == 3:
            return corners
        return np.concatenate([corners, self._box_origins + 0.5])

    @cached_property
    def _box_origins(self) -> np.ndarray:
        """(n_boxes, ndim) int64 lower corner (i, j[, k]) of every box, in box order."""
        axes = [np.arange(s) for s in self.shape]
        grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1)
        return grid.transpose(*reversed(range(self.ndim)), self.ndim).reshape(-1, self.ndim)

    def _corner_id(self, corner: np.ndarray) -> np.ndarray:
        """Vertex id of integer corner positions (..., ndim)."""
        ids = np.zeros(corner.shape[:-1], dtype=np.int64)
        for axis in reversed(range(self.ndim)):
            ids = ids * (self.shape[axis] + 1) + corner[..., axis]
        return ids

    @cached_property
    def _cell_vertex_ids(self) -> np.ndarray:
        """(C, ndim + 1) int64 vertex ids per cell (see the module docstring for the order)."""
        origins = self._box_origins
        if self.ndim == 2:
            corners = self._corner_id(origins[:, None, None, :] + _TRI_CORNERS[None])  # (B, 4, 2)
            n_corners = math.prod(s + 1 for s in self.shape)
            centre = np.arange(self.n_boxes, dtype=np.int64) + n_corners
            centre = np.broadcast_to(centre[:, None, None], (self.n_boxes, 4, 1))
            ids = np.concatenate([centre, corners], axis=-1)
        else:
            parity = origins.sum(axis=-1) % 2
            ids = self._corner_id(origins[:, None, None, :] + _TET_CORNERS[parity])  # (B, 5, 4)
        return np.ascontiguousarray(ids.reshape(self.n_cells, self.ndim + 1))

    @cached_property
    def _facet_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Interior (cells (F, 2), vertex ids (F, n)) and boundary (cells (Fb,), vertex ids (Fb, n)) facets."""
        n = self.ndim
        ids = self._cell_vertex_ids
        drop = np.array([[k for k in range(n + 1) if k != skip] for skip in range(n + 1)])
        facets = np.sort(ids[:, drop], axis=-1).reshape(-1, n)  # (C * (n + 1), n)
        owner = np.repeat(np.arange(self.n_cells, dtype=np.int64), n + 1)
        key = _facet_key(facets, self.n_vertices)
        order = np.argsort(key, kind="stable")
        key, facets, owner = key[order], facets[order], owner[order]
        first = np.ones(key.shape, dtype=bool)
        first[1:] = key[1:] != key[:-1]
        start = np.flatnonzero(first)
        counts = np.diff(np.append(start, key.size))
        shared, single = start[counts == 2], start[counts == 1]
        pairs = np.stack([owner[shared], owner[shared + 1]], axis=-1)
        return pairs, facets[shared], owner[single], facets[single]

    # ---- public geometry ----

    def _to_domain(self, grid_points: np.ndarray) -> np.ndarray:
        lower, upper, shape = (np.asarray(v, dtype=np.float64) for v in (self.lower, self.upper, self.shape))
        return lower + grid_points * ((upper - lower) / shape)

    def vertices(self) -> torch.Tensor:
        """(V, ndim) float64 domain coordinates of all mesh vertices (2D: corners, then rectangle centres)."""
        return torch.from_numpy(self._to_domain(self._grid_vertices))

    def vertices_in_box_units(self) -> torch.Tensor:
        """(V, ndim) float64 positions of all mesh vertices in box units, (x, y[, z]) order, in the order of
        :meth:`vertices`: box ``(i, j[, k])`` spans ``[i, i + 1] x [j, j + 1] (x [k, k + 1])``, so the corners sit at
        the integers ``0 .. shape[a]`` and the 2D rectangle centres at half-integers (exact values, whatever the
        bounds). ``vertices() = lower + vertices_in_box_units() * (upper - lower) / shape``."""
        return torch.from_numpy(self._grid_vertices.copy())

    def cell_vertex_ids(self) -> torch.Tensor:
        """(C, ndim + 1) int64 indices into ``vertices()`` of every cell's vertices."""
        return torch.from_numpy(self._cell_vertex_ids.copy())

    def cell_vertices(self) -> torch.Tensor:
        """(C, ndim + 1, ndim) float64 domain coordinates of every cell's vertices."""
        return self.vertices()[self.cell_vertex_ids()]

    def centers(self) -> torch.Tensor:
        """(C, ndim) float64 cell barycentres in domain coordinates."""
        return self.cell_vertices().mean(dim=1)

    def facets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Interior facets: ``(F, 2)`` int64 pairs of cells sharing a facet, ``(F, ndim)`` int64 its vertex ids."""
        pairs, verts, _, _ = self._facet_table
        return torch.from_numpy(pairs.copy()), torch.from_numpy(verts.copy())

    def boundary_facets(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Facets on the box boundary: ``(Fb,)`` int64 owning cell, ``(Fb, ndim)`` int64 vertex ids, ``(Fb, ndim)``
        float64 outward unit normal (an axis direction)."""
        _, _, cells, verts = self._facet_table
        grid = self._grid_vertices[verts]  # (Fb, n, n)
        shape = np.asarray(self.shape, dtype=np.float64)
        at_lower = (grid == 0).all(axis=1)  # (Fb, n): facet lies in the plane axis = lower
        at_upper = (grid == shape).all(axis=1)
        normals = at_upper.astype(np.float64) - at_lower.astype(np.float64)
        return torch.from_numpy(cells.copy()), torch.from_numpy(verts.copy()), torch.from_numpy(normals)

    @cached_property
    def _facet_planes(self) -> tuple[np.ndarray, np.ndarray]:
        """(C, n + 1, n + 1) float64 barycentric rows and (C, n + 1) int64 neighbours (see :meth:`facet_planes`)."""
        n = self.ndim
        corners = self._to_domain(self._grid_vertices)[self._cell_vertex_ids]  # (C, n + 1, n)
        lifted = np.concatenate([corners, np.ones((*corners.shape[:-1], 1))], axis=-1)  # rows [v_f; 1]
        planes = np.linalg.inv(lifted.transpose(0, 2, 1))  # planes @ [v_g; 1] = delta_fg
        drop = np.array([[k for k in range(n + 1) if k != skip] for skip in range(n + 1)])
        facets = np.sort(self._cell_vertex_ids[:, drop], axis=-1).reshape(-1, n)  # facet f of cell c: row c (n+1) + f
        key = _facet_key(facets, self.n_vertices)
        order = np.argsort(key, kind="stable")
        pair = np.flatnonzero(key[order][1:] == key[order][:-1])  # sorted positions p, p + 1 share one facet
        neighbors = np.full(key.shape, -1, dtype=np.int64)
        first, second = order[pair], order[pair + 1]
        neighbors[first], neighbors[second] = second // (n + 1), first // (n + 1)
        return planes, neighbors.reshape(self.n_cells, n + 1)

    def facet_planes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each cell's barycentric coordinates and neighbours, for following a flow from cell to cell.

        Returns ``planes (C, n + 1, n + 1)`` float64 and ``neighbors (C, n + 1)`` int64. Row ``f`` of ``planes[c]``
        gives the barycentric coordinate of cell ``c``'s vertex ``f`` (in :meth:`cell_vertex_ids` order) at a domain
        point ``x``: ``planes[c, f, :n] . x + planes[c, f, n]``. It is 1 at that vertex, 0 on the facet opposite it,
        and a point lies in the cell when all ``n + 1`` are non-negative. ``neighbors[c, f]`` is the cell across that
        facet, ``-1`` where the facet lies on the box boundary."""
        planes, neighbors = self._facet_planes
        return torch.from_numpy(planes.copy()), torch.from_numpy(neighbors.copy())

    def locate(self, points: torch.Tensor) -> torch.Tensor:
        """Cell ids ``(...,)`` int64 of domain points ``(..., ndim)``, by closed-form index arithmetic.

        Works in the points' float dtype and on their device. Points outside the box get the cell of their projection
        onto the box; NaN coordinates are treated as ``lower``. See the module docstring for the cell numbering.
        """
        if points.shape[-1:] != (self.ndim,):
            raise ValueError(f"points must have shape (..., {self.ndim}), got {tuple(points.shape)}")
        if not points.is_floating_point():
            points = points.to(torch.float64)
        dtype, device = points.dtype, points.device
        assert self.lower is not None and self.upper is not None  # set by __post_init__
        lower = device_constant(self.lower, dtype, device)
        extent = device_constant(self.upper, dtype, device) - lower
        counts = device_constant(tuple(map(float, self.shape)), dtype, device)
        t = torch.nan_to_num((points - lower) / extent, nan=0.0).clamp(0.0, 1.0) * counts
        box = torch.minimum(t.floor(), counts - 1)  # x == upper belongs to the last box
        local = (t - box).clamp(0.0, 1.0)  # from the same clamped box index: consistent on every box boundary
        box = box.long()
        if self.ndim == 2:
            lx, ly = local.unbind(-1)
            above_main = ly > lx
            above_anti = ly > 1.0 - lx
            cell = 2 * above_main.long() + (above_main != above_anti).long()
            b = box[..., 0] + self.shape[0] * box[..., 1]
        else:
            odd = (box.sum(dim=-1) % 2) == 1
            lx, ly, lz = local.unbind(-1)
            lx = torch.where(odd, 1.0 - lx, lx)
            cell = (
                (lx - ly - lz > 0).long()
                + 2 * (ly - lx - lz > 0).long()
                + 3 * (lz - lx - ly > 0).long()
                + 4 * (lx + ly + lz > 2).long()
            )
            b = box[..., 0] + self.shape[0] * (box[..., 1] + self.shape[1] * box[..., 2])
        return self.cells_per_box * b + cell
