"""Coordinate conventions, image grids and sampling.

* World points: LPS millimetres, (x, y[, z]) order, shape ``(..., ndim)``.
* Index points: continuous voxel indices in (i, j[, k]) = (x, y[, z]) order; integer values are voxel centres.
* Image tensors: ``[z, y, x]`` (3D) or ``[y, x]`` (2D) layout, i.e. index order reversed, as numpy/SimpleITK store it.
"""

from regkit.spatial.grid import Grid

__all__ = ["Grid"]
