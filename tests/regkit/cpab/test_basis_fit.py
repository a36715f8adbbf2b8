"""CPABasis.fit_vertex_velocities: the inverse of vertex_velocities, and exact refinement of nested tessellations."""

import pytest
import torch

from regkit.cpab.basis import cpa_basis
from regkit.cpab.tessellation import Tessellation


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
