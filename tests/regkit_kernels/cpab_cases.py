"""Shared inputs of the compiled-CPAB tests: tessellations, awkward points and random velocities."""

import torch

from regkit.cpab.basis import BOUNDARY_MODES, CPABasis, cpa_basis
from regkit.cpab.tessellation import Tessellation

# (shape, lower, upper): unit boxes, odd anisotropic boxes (division by the extents) and shifted boxes with
# power-of-two extents.
TESSELLATIONS = {
    2: [((2, 2), None, None), ((3, 2), (-1.0, 0.5), (2.0, 1.25)), ((3, 2), (-1.0, 0.25), (1.0, 0.5))],
    3: [
        ((2, 2, 2), None, None),
        ((1, 2, 3), (-2.0, 0.0, 1.0), (1.0, 0.75, 4.0)),
        ((2, 2, 3), (-2.0, 0.125, 0.5), (2.0, 0.375, 1.5)),
    ],
}


def awkward_points(tess: Tessellation, n_random: int, batch: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """(batch, N, n) domain points: every mesh vertex and facet midpoint (points on shared facets), cell centres, and
    random points in a box 20% larger than the domain on each side (so some start outside)."""
    verts = tess.vertices()
    ids = tess.cell_vertex_ids()
    pairs = torch.combinations(torch.arange(tess.ndim + 1), 2)
    midpoints = verts[ids[:, pairs]].mean(dim=2).reshape(-1, tess.ndim)
    special = torch.cat([verts, midpoints, tess.centers()])
    lower = torch.tensor(tess.lower, dtype=torch.float64)
    upper = torch.tensor(tess.upper, dtype=torch.float64)
    random = lower + (upper - lower) * (1.4 * torch.rand(batch, n_random, tess.ndim, dtype=torch.float64) - 0.2)
    return torch.cat([special.expand(batch, -1, -1), random], dim=1).to(dtype=dtype, device=device)


def case(
    ndim: int, which: int, boundary: str, dtype: torch.dtype, device: str = "cpu", n_random: int = 200, batch: int = 2
) -> tuple[CPABasis, torch.Tensor, torch.Tensor]:
    """A basis on ``TESSELLATIONS[ndim][which]``, random ``theta (batch, d)`` with large velocities (points cross
    many cells) and ``awkward_points``; seeded by the arguments."""
    torch.manual_seed(100 * ndim + 10 * which + BOUNDARY_MODES.index(boundary))
    shape, lower, upper = TESSELLATIONS[ndim][which]
    tess = Tessellation(shape, lower, upper)
    basis = cpa_basis(tess, boundary)
    scale = max(u - lo for lo, u in zip(tess.lower, tess.upper, strict=True))
    theta = (2.0 * scale * torch.randn(batch, basis.d, dtype=torch.float64)).to(dtype=dtype, device=device)
    return basis, theta, awkward_points(tess, n_random, batch, dtype, device)
