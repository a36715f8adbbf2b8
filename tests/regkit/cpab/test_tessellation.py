"""Tessellation geometry and closed-form point location, checked against barycentric point-in-simplex tests."""

from __future__ import annotations

import math

import pytest
import torch

from regkit.cpab.tessellation import Tessellation

SHAPES_2D = [(1, 1), (2, 2), (4, 4), (8, 8), (3, 5), (7, 2)]
SHAPES_3D = [(1, 1, 1), (2, 2, 2), (4, 4, 4), (8, 8, 8), (3, 4, 5), (2, 1, 3)]
BOUNDS = {2: ((-1.5, 2.0), (3.0, 2.25)), 3: ((-1.5, 2.0, 0.0), (3.0, 2.25, 8.0))}


def tessellations() -> list[Tessellation]:
    out = []
    for shape in SHAPES_2D + SHAPES_3D:
        out.append(Tessellation(shape))
        lower, upper = BOUNDS[len(shape)]
        out.append(Tessellation(shape, lower, upper))
    return out


def barycentric(tess: Tessellation, cells: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """(N, ndim + 1) float64 barycentric coordinates of points (N, ndim) in the given cells (N,)."""
    verts = tess.cell_vertices()[cells]  # (N, n+1, n)
    ones = torch.ones((*verts.shape[:-1], 1), dtype=torch.float64)
    system = torch.cat([verts, ones], dim=-1).transpose(-1, -2)  # columns [p_k; 1]
    rhs = torch.cat([points.to(torch.float64), torch.ones(len(points), 1, dtype=torch.float64)], dim=-1)
    return torch.linalg.solve(system, rhs)


def assert_contains(tess: Tessellation, points: torch.Tensor, tol: float) -> None:
    cells = tess.locate(points)
    assert cells.dtype == torch.int64 and cells.shape == points.shape[:-1]
    assert int(cells.min()) >= 0 and int(cells.max()) < tess.n_cells
    lam = barycentric(tess, cells, points)
    worst = float(lam.min())
    assert worst >= -tol, f"{tess}: a point lies outside its cell (barycentric {worst:.3g})"


def facet_points(tess: Tessellation, generator: torch.Generator) -> torch.Tensor:
    """Random points on every facet (interior and boundary), every vertex, and on the upper faces of the box."""
    verts = tess.vertices()
    _, interior = tess.facets()
    _, boundary, _ = tess.boundary_facets()
    facets = torch.cat([interior, boundary])
    weights = torch.rand(len(facets), tess.ndim, generator=generator, dtype=torch.float64)
    weights = weights / weights.sum(dim=1, keepdim=True)
    on_facets = (verts[facets] * weights[..., None]).sum(dim=1)
    edge_mid = verts[facets[:, :2]].mean(dim=1)
    upper = torch.tensor(tess.upper, dtype=torch.float64)
    on_upper = []
    for axis in range(tess.ndim):
        pts = verts.clone()
        pts[:, axis] = upper[axis]
        on_upper.append(pts)
    return torch.cat([verts, on_facets, edge_mid, *on_upper])


@pytest.mark.parametrize("tess", tessellations(), ids=str)
def test_locate_matches_barycentric(tess: Tessellation, float_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    lower, upper = torch.tensor(tess.lower), torch.tensor(tess.upper)
    uniform = lower + (upper - lower) * torch.rand(2000, tess.ndim, generator=gen, dtype=torch.float64)
    points = torch.cat([uniform, facet_points(tess, gen)]).to(float_dtype)
    tol = 1e-9 if float_dtype == torch.float64 else 1e-5 * max(tess.shape)
    assert_contains(tess, points, tol)


@pytest.mark.parametrize("tess", tessellations(), ids=str)
def test_locate_box_boundaries_in_float(tess: Tessellation) -> None:
    """Points computed as lower + i * extent / n in float32 (exact in binary for n = 2, 4, 8) on every box plane."""
    axes = [
        torch.linspace(lo, up, 4 * n + 1, dtype=torch.float32)
        for lo, up, n in zip(tess.lower, tess.upper, tess.shape, strict=True)
    ]
    points = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, tess.ndim)
    assert_contains(tess, points, 1e-5 * max(tess.shape))


@pytest.mark.parametrize("tess", tessellations(), ids=str)
def test_centers_locate_to_their_cell(tess: Tessellation) -> None:
    assert torch.equal(tess.locate(tess.centers()), torch.arange(tess.n_cells))


@pytest.mark.parametrize("tess", tessellations(), ids=str)
def test_outside_points_use_the_projection(tess: Tessellation) -> None:
    gen = torch.Generator().manual_seed(1)
    lower, upper = torch.tensor(tess.lower), torch.tensor(tess.upper)
    extent = upper - lower
    points = lower - extent + 3 * extent * torch.rand(3000, tess.ndim, generator=gen, dtype=torch.float64)
    projected = torch.minimum(torch.maximum(points, lower), upper)
    assert torch.equal(tess.locate(points), tess.locate(projected))
    assert_contains(tess, projected, 1e-9)
    far = torch.stack([lower - 1e30, upper + 1e30, torch.full_like(lower, math.inf), torch.full_like(lower, -math.inf)])
    assert torch.equal(tess.locate(far), tess.locate(torch.stack([lower, upper, upper, lower])))


def test_locate_batch_shape_and_validation() -> None:
    tess = Tessellation((3, 2))
    points = torch.rand(4, 5, 2)
    assert tess.locate(points).shape == (4, 5)
    with pytest.raises(ValueError, match=r"\(\.\.\., 2\)"):
        tess.locate(torch.rand(5, 3))
    assert tess.locate(torch.tensor([[1, 1]])).tolist() == [tess.locate(torch.tensor([[1.0, 1.0]])).item()]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shape": (2,)}, "2D or 3D"),
        ({"shape": (2, 0)}, "positive integers"),
        ({"shape": (2, 1.5)}, "positive integers"),
        ({"shape": (2, 2), "lower": (0.0, 0.0, 0.0)}, "2 entries"),
        ({"shape": (2, 2), "lower": (1.0, 0.0)}, "lower < upper"),
        ({"shape": (2, 2), "upper": (1.0, math.nan)}, "finite"),
    ],
)
def test_invalid_tessellations(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Tessellation(**kwargs)


def test_normalised_fields() -> None:
    tess = Tessellation([2, 3], lower=[0, -1], upper=[1, 1])
    assert tess.shape == (2, 3) and tess.lower == (0.0, -1.0) and tess.upper == (1.0, 1.0)
    assert Tessellation((2, 2, 2)).lower == (0.0, 0.0, 0.0) and Tessellation((2, 2, 2)).upper == (1.0, 1.0, 1.0)
    assert tess == Tessellation((2, 3), (0.0, -1.0), (1.0, 1.0))


@pytest.mark.parametrize("tess", tessellations(), ids=str)
def test_cells_tile_the_box_with_positive_orientation(tess: Tessellation) -> None:
    n = tess.ndim
    verts = tess.cell_vertices()
    assert verts.shape == (tess.n_cells, n + 1, n) and verts.dtype == torch.float64
    assert tess.n_cells == tess.cells_per_box * math.prod(tess.shape)
    assert tess.vertices().shape == (tess.n_vertices, n)
    volumes = torch.linalg.det(verts[:, 1:] - verts[:, :1]) / math.factorial(n)
    assert (volumes > 0).all()
    box_volume = math.prod(up - lo for lo, up in zip(tess.lower, tess.upper, strict=True))
    assert float(volumes.sum()) == pytest.approx(box_volume, rel=1e-12)
    assert torch.equal(tess.centers(), verts.mean(dim=1))


@pytest.mark.parametrize("tess", tessellations(), ids=str)
def test_vertices_in_box_units_are_the_lattice_and_map_to_the_vertices(tess: Tessellation) -> None:
    units = tess.vertices_in_box_units()
    assert units.shape == (tess.n_vertices, tess.ndim) and units.dtype == torch.float64
    shape = torch.tensor(tess.shape, dtype=torch.float64)
    corners = math.prod(s + 1 for s in tess.shape)
    assert torch.equal(units[:corners], units[:corners].round()) and (units >= 0).all() and (units <= shape).all()
    assert torch.equal(units[corners:] % 1, torch.full_like(units[corners:], 0.5))  # the 2D rectangle centres
    lower, upper = torch.tensor(tess.lower, dtype=torch.float64), torch.tensor(tess.upper, dtype=torch.float64)
    torch.testing.assert_close(tess.vertices(), lower + units * (upper - lower) / shape, rtol=0, atol=1e-12)
    units[0] = -1.0  # a fresh tensor: the tessellation is unchanged
    assert (tess.vertices_in_box_units() >= 0).all()


def test_2d_local_order() -> None:
    """local 0, 1, 2, 3 = the triangles on the y-low, x-high, y-high and x-low edges of each rectangle."""
    tess = Tessellation((3, 2), (0.0, 0.0), (3.0, 2.0))
    edge_midpoints = torch.tensor([[0.5, 0.0], [1.0, 0.5], [0.5, 1.0], [0.0, 0.5]], dtype=torch.float64)
    for b, (i, j) in enumerate([(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]):
        offset = torch.tensor([i, j], dtype=torch.float64)
        towards_centre = 0.1 * (torch.tensor([0.5, 0.5], dtype=torch.float64) - edge_midpoints)
        cells = tess.locate(edge_midpoints + towards_centre + offset)
        assert cells.tolist() == [4 * b + local for local in range(4)]


def test_3d_corner_tetrahedra_and_parity() -> None:
    tess = Tessellation((2, 1, 1), (0.0, 0.0, 0.0), (2.0, 1.0, 1.0))
    verts = tess.cell_vertices()
    even_corners = [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 1)]
    for local, corner in enumerate(even_corners, start=1):
        assert list(corner) in verts[local].tolist()  # cube 0 is even
        mirrored = [2 - corner[0], corner[1], corner[2]]  # cube 1 is odd: mirror in x, shifted by one box
        assert mirrored in verts[5 + local].tolist()
    global_parity = verts[[0, 5]].sum(dim=-1) % 2
    assert (global_parity == 0).all()  # both central tetrahedra use even-sum corners


def expected_facet_counts(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 2:
        nx, ny = shape
        return 4 * nx * ny + (nx - 1) * ny + nx * (ny - 1), 2 * (nx + ny)
    nx, ny, nz = shape
    shared_squares = (nx - 1) * ny * nz + nx * (ny - 1) * nz + nx * ny * (nz - 1)
    return 4 * nx * ny * nz + 2 * shared_squares, 4 * (nx * ny + ny * nz + nx * nz)


@pytest.mark.parametrize("tess", tessellations(), ids=str)
def test_facets(tess: Tessellation) -> None:
    """Every facet is shared by exactly two cells or lies on the box boundary (faces conform)."""
    n = tess.ndim
    pairs, interior = tess.facets()
    cells, boundary, normals = tess.boundary_facets()
    assert (len(pairs), len(cells)) == expected_facet_counts(tess.shape)
    ids = tess.cell_vertex_ids()
    for cell in (pairs[:, 0], pairs[:, 1]):
        assert (ids[cell][:, :, None] == interior[:, None, :]).any(dim=1).all()  # facet vertices belong to the cell
    assert (ids[cells][:, :, None] == boundary[:, None, :]).any(dim=1).all()
    assert (normals.abs().sum(dim=1) == 1).all()
    verts = tess.vertices()[boundary]  # (Fb, n, n)
    lower, upper = torch.tensor(tess.lower, dtype=torch.float64), torch.tensor(tess.upper, dtype=torch.float64)
    plane = torch.where(normals > 0, upper, lower)
    on_plane = (verts == plane[:, None, :]) | (normals == 0)[:, None, :]
    assert on_plane.all()
    assert interior.shape[1] == n and boundary.shape[1] == n


@pytest.mark.parametrize("shape", [(2, 2, 2), (3, 4, 5)])
def test_3d_shared_faces_conform(shape: tuple[int, int, int]) -> None:
    """On each square shared by neighbouring cubes, both cubes cut it into the same two triangles."""
    tess = Tessellation(shape)
    ids = tess.cell_vertex_ids().tolist()
    grid = (tess.vertices() * torch.tensor(shape, dtype=torch.float64)).round()
    nx, ny, _ = shape

    def face_triangles(box: int, axis: int, value: float) -> set[frozenset[int]]:
        tris = set()
        for cell in range(5 * box, 5 * box + 5):
            on_face = [v for v in ids[cell] if float(grid[v, axis]) == value]
            if len(on_face) == 3:
                tris.add(frozenset(on_face))
        return tris

    checked = 0
    for k in range(shape[2]):
        for j in range(shape[1]):
            for i in range(shape[0]):
                box = i + nx * (j + ny * k)
                for axis, stride in enumerate((1, nx, nx * ny)):
                    if (i, j, k)[axis] + 1 < shape[axis]:
                        here = face_triangles(box, axis, (i, j, k)[axis] + 1)
                        there = face_triangles(box + stride, axis, (i, j, k)[axis] + 1)
                        assert len(here) == 2 and here == there
                        checked += 1
    assert checked == (nx - 1) * ny * shape[2] + nx * (ny - 1) * shape[2] + nx * ny * (shape[2] - 1)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tess", [Tessellation((8, 8)), Tessellation((3, 5), (-1.0, 0.0), (1.0, 2.0)), Tessellation((4, 3, 5))], ids=str
)
def test_locate_cuda_matches_cpu(tess: Tessellation) -> None:
    gen = torch.Generator().manual_seed(2)
    points = torch.cat([facet_points(tess, gen), torch.rand(5000, tess.ndim, generator=gen, dtype=torch.float64)])
    for dtype in (torch.float32, torch.float64):
        cpu = tess.locate(points.to(dtype))
        cuda = tess.locate(points.to(dtype).cuda())
        assert cuda.device.type == "cuda"
        assert_contains(tess, points.to(dtype).cuda().cpu(), 1e-5 * max(tess.shape))
        assert torch.equal(cpu, cuda.cpu())


@pytest.mark.parametrize("shape", [(3, 2), (2, 3, 2)])
def test_facet_planes_are_barycentric_and_neighbors_share_facets(shape: tuple[int, ...]) -> None:
    tess = Tessellation(shape, lower=(-1.0,) * len(shape), upper=(2.0,) * len(shape))
    n = tess.ndim
    planes, neighbors = tess.facet_planes()
    assert planes.shape == (tess.n_cells, n + 1, n + 1) and neighbors.shape == (tess.n_cells, n + 1)
    at_vertices = torch.einsum("cfi,cgi->cfg", planes[..., :n], tess.cell_vertices()) + planes[..., n, None]
    torch.testing.assert_close(at_vertices, torch.eye(n + 1, dtype=torch.float64).expand_as(at_vertices))
    ids = tess.cell_vertex_ids()
    boundary_cells, _, _ = tess.boundary_facets()
    assert int((neighbors < 0).sum()) == boundary_cells.numel()
    for cell, facet in (neighbors >= 0).nonzero().tolist():
        other = int(neighbors[cell, facet])
        shared = set(ids[cell].tolist()) - {int(ids[cell, facet])}
        assert shared <= set(ids[other].tolist()) and cell in neighbors[other].tolist()
