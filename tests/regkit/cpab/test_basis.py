"""regkit.cpab.basis: the sparse nodal CPA basis against the constraint matrix, its dense SVD null space and the
field's properties, and ``fit_vertex_velocities``: the inverse of ``vertex_velocities``, exact refinement of nested
tessellations."""

from __future__ import annotations

import math

import pytest
import torch

from regkit._backend import BackendError
from regkit.cpab.basis import BOUNDARY_MODES, CPABasis, constraint_matrix, cpa_basis, dense_svd_basis
from regkit.cpab.tessellation import Tessellation

SMALL = [
    Tessellation((1, 1)),
    Tessellation((2, 2)),
    Tessellation((3, 2), (-1.0, 0.5), (2.0, 1.0)),
    Tessellation((4, 3)),
    Tessellation((1, 1, 1)),
    Tessellation((2, 2, 2)),
    Tessellation((2, 1, 3), (0.0, -2.0, 1.0), (1.5, 2.0, 2.0)),
    Tessellation((3, 2, 2)),
]
CASES = [(tess, boundary, vp) for tess in SMALL for boundary in BOUNDARY_MODES for vp in (False, True)]


def case_id(case: tuple[Tessellation, str, bool]) -> str:
    tess, boundary, vp = case
    return f"{'x'.join(map(str, tess.shape))}-{boundary}{'-vp' if vp else ''}{'-box' if tess.lower[0] else ''}"


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def basis(request: pytest.FixtureRequest) -> CPABasis:
    return cpa_basis(*request.param)


def expected_d(shape: tuple[int, ...], boundary: str) -> int:
    if len(shape) == 2:
        nx, ny = shape
        return {
            "zero": 2 * ((nx - 1) * (ny - 1) + nx * ny),
            "normal": 2 * ((nx - 1) * (ny - 1) + nx * ny) + 2 * (nx - 1) + 2 * (ny - 1),
            "free": 2 * ((nx + 1) * (ny + 1) + nx * ny),
        }[boundary]
    nx, ny, nz = shape
    return {
        "zero": 3 * (nx - 1) * (ny - 1) * (nz - 1),
        "normal": (nx - 1) * (ny + 1) * (nz + 1) + (nx + 1) * (ny - 1) * (nz + 1) + (nx + 1) * (ny + 1) * (nz - 1),
        "free": 3 * (nx + 1) * (ny + 1) * (nz + 1),
    }[boundary]


@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (4, 4), (3, 5), (12, 7), (1, 1, 1), (2, 2, 2), (3, 4, 5), (6, 2, 3)])
@pytest.mark.parametrize("boundary", BOUNDARY_MODES)
def test_d_formulas(shape: tuple[int, ...], boundary: str) -> None:
    basis = cpa_basis(Tessellation(shape), boundary)
    assert basis.d == expected_d(shape, boundary)
    assert basis.matrix.shape == (Tessellation(shape).n_cells * len(shape) * (len(shape) + 1), basis.d)


def test_fg_cpab_dimensions() -> None:
    """The published dimensions: FG-CPAB 24 x 24 and 30 x 30 (zero), libcpab 4 x 4 and 10 x 10 (normal)."""
    assert cpa_basis(Tessellation((24, 24))).d == 2210
    assert cpa_basis(Tessellation((30, 30))).d == 3482
    assert cpa_basis(Tessellation((4, 4)), "normal").d == 62
    assert cpa_basis(Tessellation((10, 10)), "normal").d == 398


@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (3, 3), (4, 4), (2, 5), (3, 7), (9, 4)])
def test_volume_preserving_d_2d(shape: tuple[int, int]) -> None:
    nx, ny = shape
    d = [cpa_basis(Tessellation(shape), boundary, volume_preserving=True).d for boundary in BOUNDARY_MODES]
    assert d == [max(nx - 2, 0) * max(ny - 2, 0), nx * ny - 1, (nx + 2) * (ny + 2) - 2]


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((1, 1, 1), [0, 0, 19]), ((2, 2, 2), [0, 3, 45]), ((3, 3, 3), [0, 11, 85]), ((2, 3, 4), [0, 2, 83])],
)
def test_volume_preserving_d_3d(shape: tuple[int, int, int], expected: list[int]) -> None:
    """Measured values (no closed form): divergence-free P1 fields lock, completely so with the zero boundary."""
    d = [cpa_basis(Tessellation(shape), boundary, volume_preserving=True).d for boundary in BOUNDARY_MODES]
    assert d == expected


def test_constraints_annihilate_basis(basis: CPABasis) -> None:
    L = constraint_matrix(basis.tess, basis.boundary, basis.volume_preserving)
    assert L.is_sparse and L.shape[1] == basis.matrix.shape[0]
    residual = torch.sparse.mm(L, basis.matrix.to_dense())
    assert worst(residual) < 1e-10


def test_column_space_matches_dense_svd(basis: CPABasis) -> None:
    dense = dense_svd_basis(basis.tess, basis.boundary, basis.volume_preserving)
    B = basis.matrix.to_dense()
    assert dense.shape[1] == basis.d
    if basis.d == 0:
        return
    assert torch.linalg.matrix_rank(B) == basis.d
    inside = dense @ (dense.T @ B)
    assert (inside - B).abs().max() < 1e-10
    assert torch.allclose(B.norm(dim=0), torch.ones(basis.d, dtype=torch.float64), atol=1e-12)


def test_to_A_and_project_equal_the_matrix(basis: CPABasis) -> None:
    gen = torch.Generator().manual_seed(0)
    tess, n = basis.tess, basis.tess.ndim
    theta = torch.randn(3, basis.d, generator=gen, dtype=torch.float64)
    A = basis.to_A(theta)
    assert A.shape == (3, tess.n_cells, n, n + 1)
    expected = (basis.matrix @ theta.T).T.reshape(A.shape)
    assert torch.allclose(A, expected, atol=1e-12)
    assert torch.allclose(basis.to_A(theta[1]), A[1], atol=1e-12)
    grad = torch.randn(2, 3, tess.n_cells, n, n + 1, generator=gen, dtype=torch.float64)
    projected = basis.project(grad)
    assert projected.shape == (2, 3, basis.d)
    expected = (basis.matrix.t() @ grad.reshape(6, -1).T).T.reshape(2, 3, basis.d)
    assert torch.allclose(projected, expected, atol=1e-12)
    # adjointness <to_A(theta), G> == <theta, project(G)>
    lhs = (basis.to_A(theta) * grad[0]).sum()
    rhs = (theta * basis.project(grad[0])).sum()
    assert torch.allclose(lhs, rhs, atol=1e-10)


def test_to_A_dtype_and_autograd() -> None:
    basis = cpa_basis(Tessellation((3, 2)), "normal", volume_preserving=True)
    theta = torch.randn(2, basis.d, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(basis.to_A, (theta,))
    grad_A = torch.randn(basis.tess.n_cells, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(basis.project, (grad_A,))
    plain = cpa_basis(Tessellation((2, 2, 2)), "free")
    theta32 = torch.randn(plain.d, dtype=torch.float32)
    A = plain.to_A(theta32)
    assert A.dtype == torch.float32
    assert torch.allclose(A.double(), plain.to_A(theta32.double()), atol=1e-5)
    with pytest.raises(ValueError, match="theta must have shape"):
        plain.to_A(torch.zeros(plain.d + 1))


def random_facet_points(verts: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random convex combinations of simplex vertices (F, m, n) -> (F, n)."""
    weights = torch.rand(verts.shape[:2], generator=gen, dtype=torch.float64)
    return (verts * (weights / weights.sum(dim=1, keepdim=True))[..., None]).sum(dim=1)


def worst(values: torch.Tensor) -> float:
    return float(values.abs().max()) if values.numel() else 0.0


def affine(A: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    return (A[..., :-1] @ points[..., None]).squeeze(-1) + A[..., -1]


def test_field_properties(basis: CPABasis) -> None:
    """Continuity across every shared facet, the boundary condition on boundary facets, zero trace."""
    gen = torch.Generator().manual_seed(1)
    tess = basis.tess
    A = basis.to_A(torch.randn(basis.d, generator=gen, dtype=torch.float64))
    verts = tess.vertices()
    pairs, shared = tess.facets()
    points = random_facet_points(verts[shared], gen)
    assert torch.allclose(affine(A[pairs[:, 0]], points), affine(A[pairs[:, 1]], points), atol=1e-10)
    cells, boundary, normals = tess.boundary_facets()
    points = random_facet_points(verts[boundary], gen)
    v = affine(A[cells], points)
    if basis.boundary == "zero":
        assert v.abs().max() < 1e-10
    elif basis.boundary == "normal":
        assert (v * normals).sum(dim=1).abs().max() < 1e-10
    trace = A[..., :-1].diagonal(dim1=-2, dim2=-1).sum(dim=-1)
    if basis.volume_preserving:
        assert worst(trace) < 1e-10


def test_velocity_at_points() -> None:
    tess = Tessellation((3, 4), (0.0, -1.0), (3.0, 1.0))
    basis = cpa_basis(tess, "normal")
    gen = torch.Generator().manual_seed(2)
    theta = torch.randn(2, basis.d, generator=gen, dtype=torch.float64)
    points = torch.rand(2, 5, 7, 2, generator=gen, dtype=torch.float64) * torch.tensor([3.0, 2.0]) - torch.tensor(
        [0.0, 1.0]
    )
    v = basis.velocity(theta, points)
    assert v.shape == points.shape
    A = basis.to_A(theta)
    cells = tess.locate(points)
    for b in range(2):
        assert torch.allclose(v[b], affine(A[b][cells[b]], points[b]))
        assert torch.allclose(basis.velocity(theta[b], points[b]), v[b])
    # at the vertices the field takes its nodal values
    vertex_v = basis.velocity(theta[0], tess.vertices())
    assert torch.allclose(vertex_v, basis.vertex_velocities(theta[0]), atol=1e-12)
    with pytest.raises(ValueError, match="points must be"):
        basis.velocity(theta, points[0])


def test_nodal_coordinates() -> None:
    """theta_i is the velocity component free_axis[i] at vertex free_vertex[i], divided by scale[i]."""
    basis = cpa_basis(Tessellation((2, 3, 2)), "normal")
    i = basis.d // 2
    theta = torch.zeros(basis.d, dtype=torch.float64)
    theta[i] = 1.0
    vel = basis.vertex_velocities(theta)
    assert vel[basis.free_vertex[i], basis.free_axis[i]] == basis.scale[i]
    assert torch.count_nonzero(vel) == 1


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="boundary mode 'periodic'"):
        cpa_basis(Tessellation((2, 2)), "periodic")
    with pytest.raises(ValueError, match="too fine"):
        cpa_basis(Tessellation((48, 48)), "zero", volume_preserving=True)
    basis = cpa_basis(Tessellation((2, 2)))
    with pytest.raises(ValueError, match="grad_A must have shape"):
        basis.project(torch.zeros(3, 2, 3))


@pytest.mark.parametrize("shape", [(32, 32), (16, 16, 16)])
def test_large_builds(shape: tuple[int, ...]) -> None:
    """The realistic sizes build sparsely (about a second) and stay consistent."""
    tess = Tessellation(shape)
    basis = cpa_basis(tess)
    assert basis.d == expected_d(shape, "zero")
    n = tess.ndim
    assert basis.matrix._nnz() <= tess.n_cells * n * (n + 1) ** 2
    gen = torch.Generator().manual_seed(3)
    theta = torch.randn(basis.d, generator=gen, dtype=torch.float64)
    A = basis.to_A(theta)
    assert torch.allclose(A.flatten(), basis.matrix @ theta, atol=1e-12)
    pairs, shared = tess.facets()
    points = random_facet_points(tess.vertices()[shared], gen)
    assert torch.allclose(affine(A[pairs[:, 0]], points), affine(A[pairs[:, 1]], points), atol=1e-10)
    assert math.isclose(float(basis.project(A).dot(theta)), float(A.square().sum()), rel_tol=1e-10)


@pytest.mark.slow
def test_volume_preserving_2d_24() -> None:
    basis = cpa_basis(Tessellation((24, 24)), "zero", volume_preserving=True)
    assert basis.d == 22 * 22
    A = basis.to_A(torch.randn(basis.d, dtype=torch.float64))
    assert A[..., :-1].diagonal(dim1=-2, dim2=-1).sum(dim=-1).abs().max() < 1e-10


@pytest.mark.gpu
def test_cuda_matches_cpu() -> None:
    basis = cpa_basis(Tessellation((4, 3, 5)), "normal", volume_preserving=True)
    theta = torch.randn(4, basis.d, dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        A = basis.to_A(theta.to(dtype).cuda())
        assert A.is_cuda and A.dtype == dtype
        assert torch.allclose(A.cpu().double(), basis.to_A(theta), atol=1e-5)
        assert torch.allclose(basis.project(A).cpu().double(), basis.project(A.cpu().double()), atol=1e-4)
        points = torch.rand(4, 100, 3, dtype=dtype, device="cuda")
        assert basis.velocity(theta.to(dtype).cuda(), points).is_cuda


@pytest.mark.parametrize("batched", [False, True])
def test_to_A_triton_face_equals_the_torch_face(batched):
    """The fused basis map (Triton's interpreter here) against the PyTorch face, forward and gradient; auto keeps the
    PyTorch face on the CPU, and volume-preserving bases refuse the fused one."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs Triton's interpreter (conftest)
    basis = cpa_basis(Tessellation((3, 2, 2), (0.0, 0.0, 0.0), (2.0, 3.0, 1.5)), "zero")
    shape = (2, basis.d) if batched else (basis.d,)
    theta = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
    fused = basis.to_A(theta, backend="triton")
    torch.testing.assert_close(fused, basis.to_A(theta, backend="torch"))
    grad = torch.randn_like(fused)
    (g_fused,) = torch.autograd.grad(fused, theta, grad)
    (g_torch,) = torch.autograd.grad(basis.to_A(theta), theta, grad)
    torch.testing.assert_close(g_fused, g_torch)
    preserving = cpa_basis(Tessellation((2, 2)), "zero", volume_preserving=True)
    with pytest.raises(BackendError, match="volume-preserving"):
        preserving.to_A(torch.zeros(preserving.d), backend="triton")


# ----------------------------------------------------------------------------------------------------------------------
# fit_vertex_velocities: the inverse of vertex_velocities, and exact refinement of nested tessellations


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 2)])
@pytest.mark.parametrize("boundary", ["zero", "normal", "free"])
def test_fit_inverts_vertex_velocities(shape, boundary):
    basis = cpa_basis(Tessellation(shape), boundary)
    theta = torch.randn(basis.d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(basis.fit_vertex_velocities(basis.vertex_velocities(theta)), theta, atol=1e-12)


def test_fit_inverts_with_volume_preservation():
    basis = cpa_basis(Tessellation((4, 4)), "normal", volume_preserving=True)
    theta = torch.randn(basis.d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(basis.fit_vertex_velocities(basis.vertex_velocities(theta)), theta, atol=1e-10)


@pytest.mark.parametrize("coarse,fine", [((2, 2), (4, 4)), ((2, 2, 2), (4, 4, 4))])
def test_refining_a_nested_tessellation_keeps_the_field(coarse, fine):
    coarse_basis = cpa_basis(Tessellation(coarse), "zero")
    fine_basis = cpa_basis(Tessellation(fine), "zero")
    g = torch.Generator().manual_seed(2)
    theta = torch.randn(coarse_basis.d, dtype=torch.float64, generator=g)
    vertices = fine_basis.tess.vertices()
    fine_theta = fine_basis.fit_vertex_velocities(coarse_basis.velocity(theta, vertices))
    points = torch.rand(500, len(coarse), dtype=torch.float64, generator=g)
    assert torch.allclose(fine_basis.velocity(fine_theta, points), coarse_basis.velocity(theta, points), atol=1e-10)
