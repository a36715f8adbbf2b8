"""The transformation a registration finds: a linear map and a chain of CPAB flows, evaluated in world space.

Direction (pull-back, as ITK and ANTs): the transformation maps a point ``x`` of the FIXED image's world space to the
point ``y`` of the MOVING image's world space where the moving image is sampled, so ``warped(x) = moving(y)`` and the
displacement is ``u(x) = y - x``. World points are LPS millimetres, (x, y[, z]) order.

Composition: ``y = M phi_K( ... phi_1(x))``: the CPAB flows ``phi_k`` act in the fixed image's space (their domain is
the fixed grid's box, ``CPAB.for_grid``), then the homogeneous matrix ``M`` of the linear stages maps to the moving
space. The inverse is ``x = phi_1^-1( ... phi_K^-1(M^-1 y))`` with ``phi_k^-1`` the flow of ``-theta_k``.

``Transformation.save``/``load`` keep everything needed to re-evaluate it exactly (``transform.json``): the fixed grid,
``M``, and for each CPAB its tessellation, boundary mode, steps and ``theta``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from regkit import _atomic
from regkit.cpab.module import CPAB
from regkit.errors import GeometryError, RegkitError
from regkit.spatial.grid import Grid
from regkit.spatial.sampling import sample_image

FORMAT_VERSION = 1
# What a transform file may hold (Transformation.from_dict): integration steps as the configuration allows, CPAB
# parameters within this many prior standard deviations, and a linear part this well conditioned.
MAX_STEPS = 1000
MAX_THETA = 1e4
MAX_CONDITION = 1e8
# Boxes of a flow's tessellation: 128^3, one cell per 4 voxels of a 512^3 image (the presets use at most 24^3); a
# file asking for more would take minutes and gigabytes to rebuild.
MAX_BOXES = 128**3


class TransformFileError(RegkitError):
    """A transform file that cannot be read (missing, not JSON, unknown version, inconsistent contents)."""


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _flow_from_dict(spec: dict, where: str, ndim: int) -> CPAB:
    """One flow of :meth:`Transformation.from_dict`, validated (its docstring); ``where`` (``FILE: cpab[K]``)
    prefixes errors. The exceptions of malformed entries (KeyError, TypeError, ValueError, ...) are left to the
    caller, which names the file in them."""
    steps, dtype, cells = spec["steps"], spec["dtype"], spec["cells"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise TransformFileError(f"{where}: steps must be an integer in [1, {MAX_STEPS}], got {steps!r}")
    if dtype not in ("float32", "float64"):
        raise TransformFileError(f"{where}: dtype must be float32 or float64, got {dtype!r}")
    if not (
        isinstance(cells, list)
        and len(cells) == ndim
        and all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in cells)
    ):
        raise TransformFileError(f"{where}: cells must be {ndim} positive integers, got {cells!r}")
    if math.prod(cells) > MAX_BOXES:
        raise TransformFileError(f"{where}: cells {cells} make more than {MAX_BOXES} boxes")
    if not all(_positive(spec[key]) for key in ("length_scale", "variance")):
        raise TransformFileError(f"{where}: length_scale and variance must be positive finite numbers")
    if not isinstance(spec["volume_preserving"], bool):
        raise TransformFileError(f"{where}: volume_preserving must be true or false")
    try:  # the flow's frame obeys a grid's rules: a finite origin and an orthonormal direction
        Grid.create((1,) * ndim, None, spec["origin"], spec["direction"])
    except GeometryError as err:
        raise TransformFileError(f"{where}: {err}") from None
    flow = CPAB(
        cells,
        lower=spec["lower"],
        upper=spec["upper"],
        origin=spec["origin"],
        direction=spec["direction"],
        boundary=spec["boundary"],
        volume_preserving=spec["volume_preserving"],
        steps=steps,
        length_scale=float(spec["length_scale"]),
        variance=float(spec["variance"]),
    )
    flow = flow.to(getattr(torch, dtype))
    theta = np.asarray(spec["theta"], dtype=np.float64)
    if not (np.isfinite(theta).all() and np.abs(theta).max(initial=0.0) <= MAX_THETA):
        raise TransformFileError(f"{where}: theta must be finite and at most {MAX_THETA:g} in size")
    if theta.shape != tuple(flow.theta.shape):
        raise TransformFileError(f"{where}: theta has shape {theta.shape} but the tessellation needs ({flow.basis.d},)")
    with torch.no_grad():
        flow.theta.copy_(torch.from_numpy(theta))
    flow.requires_grad_(False)
    return flow


@dataclass
class Transformation:
    """``y = matrix @ phi_K(...phi_1(x))`` from fixed world points ``x`` to moving world points ``y`` (module doc).

    Attributes:
        fixed_grid: the grid on which dense outputs (displacement, Jacobian) are evaluated; the CPAB domain.
        matrix: ``(n + 1) x (n + 1)`` float64 homogeneous matrix of the linear stages (identity if none).
        cpab: the CPAB flows, applied first to last; each has a single (unbatched) ``theta``.
    """

    fixed_grid: Grid
    matrix: np.ndarray
    cpab: list[CPAB] = field(default_factory=list)

    @property
    def ndim(self) -> int:
        return self.fixed_grid.ndim

    def _linear(self, points: torch.Tensor, matrix: np.ndarray) -> torch.Tensor:
        m = torch.as_tensor(matrix, dtype=points.dtype, device=points.device)
        n = self.ndim
        return points @ m[:n, :n].T + m[:n, n]

    @torch.no_grad()
    def transform_world(self, world: torch.Tensor, chunk: int = 2**20) -> torch.Tensor:
        """Map fixed-space world points ``(..., n)`` to moving-space world points ``(..., n)`` (no gradient)."""
        flat = world.reshape(-1, self.ndim)
        out = torch.empty_like(flat)
        for part in _chunks(flat.shape[0], chunk):
            y = flat[part]
            for flow in self.cpab:
                y = flow.transform_world(y.to(flow.theta.dtype)).to(flat.dtype)
            out[part] = self._linear(y, self.matrix)
        return out.reshape(world.shape)

    @torch.no_grad()
    def inverse_world(self, world: torch.Tensor, chunk: int = 2**20) -> torch.Tensor:
        """Map moving-space world points ``(..., n)`` back to fixed space: the inverse transformation."""
        flat = world.reshape(-1, self.ndim)
        out = torch.empty_like(flat)
        inverse_flows = [flow.inverse() for flow in reversed(self.cpab)]
        for part in _chunks(flat.shape[0], chunk):
            y = self._linear(flat[part], np.linalg.inv(self.matrix))
            for flow in inverse_flows:
                y = flow.transform_world(y.to(flow.theta.dtype)).to(flat.dtype)
            out[part] = y
        return out.reshape(world.shape)

    def displacement(self, grid: Grid | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """Pull-back displacement ``u = y - x`` at ``grid``'s voxel centres (default: the fixed grid).

        Returns ``(*grid.shape, n)`` float32 in world millimetres (LPS components, (x, y[, z]) order):
        ``x_moving = x_fixed + u(x_fixed)``, the ITK displacement-field convention.
        """
        grid = grid or self.fixed_grid
        world = grid.world_points(torch.float64, device)
        return (self.transform_world(world) - world).float()

    def inverse_displacement(self, grid: Grid, device: torch.device | str | None = None) -> torch.Tensor:
        """Displacement of the inverse transformation at ``grid``'s voxel centres (usually the moving grid):
        ``x_fixed = x_moving + v(x_moving)``, ``(*grid.shape, n)`` float32 world millimetres."""
        world = grid.world_points(torch.float64, device)
        return (self.inverse_world(world) - world).float()

    def cpab_displacement(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Displacement of the CPAB part alone, ``phi_K(...phi_1(x)) - x``, on the fixed grid (for ITK composite
        transform files, where the linear part is stored separately): ``(*fixed_grid.shape, n)`` float32 mm."""
        only_cpab = Transformation(self.fixed_grid, np.eye(self.ndim + 1), self.cpab)
        return only_cpab.displacement(device=device)

    @torch.no_grad()
    def jacobian_determinant(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``det(dy/dx)`` at the fixed grid's voxel centres, ``fixed_grid.shape`` float32.

        Analytic: ``det(M_lin)`` times the product of the CPAB flows' determinants at the intermediate points
        (each positive by construction), so it is positive wherever ``det(M_lin) > 0``.
        """
        world = self.fixed_grid.world_points(torch.float64, device).reshape(-1, self.ndim)
        det = torch.full(
            world.shape[:1], float(np.linalg.det(self.matrix[: self.ndim, : self.ndim])), dtype=world.dtype
        )
        det = det.to(world.device)
        for part in _chunks(world.shape[0], 2**20):
            y = world[part]
            for k, flow in enumerate(self.cpab):
                points = flow.world_to_domain(y.to(flow.theta.dtype))
                det[part] *= flow.jacobian_determinant(points).to(det.dtype)
                if k + 1 < len(self.cpab):  # the next flow starts where this one ends
                    y = flow.domain_to_world(flow.transform_points(points)).to(world.dtype)
        return det.reshape(self.fixed_grid.shape).float()

    @torch.no_grad()
    def warp(self, image: torch.Tensor, moving_grid: Grid, mode: str = "linear", padding: float = 0.0) -> torch.Tensor:
        """Resample ``image`` (on ``moving_grid``, ``[z, y, x]`` layout) onto the fixed grid through the
        transformation: ``warped(x) = image(y(x))``; ``mode`` ``"linear"`` or ``"nearest"`` (label maps keep their
        integer dtype). Returns ``fixed_grid.shape``."""
        world = self.fixed_grid.world_points(torch.float64, image.device)
        y = self.transform_world(world)
        values = image if mode == "nearest" or image.is_floating_point() else image.float()
        return sample_image(values, moving_grid, y.to(torch.float32), mode=mode, padding=padding)

    # ---- files -------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """A JSON-serialisable description that :meth:`from_dict` turns back into an equal transformation."""
        g = self.fixed_grid
        return {
            "format": "regkit-transform",
            "version": FORMAT_VERSION,
            "direction": "pull-back: fixed world (LPS mm) -> moving world; y = matrix @ cpab[-1](...cpab[0](x))",
            "fixed_grid": {
                "size": list(g.size),
                "spacing": list(g.spacing),
                "origin": list(g.origin),
                "direction": [list(row) for row in g.direction],
            },
            "matrix": self.matrix.tolist(),
            "cpab": [
                {
                    "cells": list(flow.tess.shape),
                    "lower": list(flow.tess.lower or ()),  # normalised to tuples by Tessellation
                    "upper": list(flow.tess.upper or ()),
                    "origin": flow.origin.tolist(),
                    "direction": flow.direction.tolist(),
                    "boundary": flow.basis.boundary,
                    "volume_preserving": flow.basis.volume_preserving,
                    "steps": flow.steps,
                    "length_scale": flow.length_scale,
                    "variance": flow.variance,
                    "dtype": str(flow.theta.dtype).removeprefix("torch."),
                    "theta": flow.theta.detach().cpu().double().tolist(),
                }
                for flow in self.cpab
            ],
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> Transformation:
        """Rebuild a transformation from :meth:`to_dict`'s output; ``source`` names the file in errors.

        Guarantees a valid transformation (a finite, invertible matrix of the grid's dimension; flows of that
        dimension with at most :data:`MAX_BOXES` boxes, a finite origin and orthonormal direction, ``steps`` in [1,
        :data:`MAX_STEPS`], finite ``theta`` within :data:`MAX_THETA`, positive finite prior settings) or raises
        :class:`TransformFileError` with one line naming ``source``.
        """
        try:
            if data.get("format") != "regkit-transform" or data.get("version") != FORMAT_VERSION:
                raise TransformFileError(
                    f"{source}: not a regkit transform file of version {FORMAT_VERSION} "
                    f"(format={data.get('format')!r}, version={data.get('version')!r})"
                )
            g = data["fixed_grid"]
            try:
                grid = Grid.create(g["size"], g["spacing"], g["origin"], g["direction"])
            except GeometryError as err:
                raise TransformFileError(f"{source}: fixed_grid: {err}") from None
            if not isinstance(data["cpab"], list):
                raise TransformFileError(f"{source}: cpab must be a list")
            flows = [_flow_from_dict(spec, f"{source}: cpab[{k}]", grid.ndim) for k, spec in enumerate(data["cpab"])]
            matrix = np.asarray(data["matrix"], dtype=np.float64)
            if matrix.shape != (grid.ndim + 1, grid.ndim + 1):
                raise TransformFileError(f"{source}: matrix must be {grid.ndim + 1}x{grid.ndim + 1}")
            if not np.isfinite(matrix).all():
                raise TransformFileError(f"{source}: matrix holds non-finite values")
            if np.linalg.cond(matrix[: grid.ndim, : grid.ndim]) > MAX_CONDITION:
                raise TransformFileError(f"{source}: matrix is singular or nearly so (not invertible)")
        except (KeyError, IndexError, TypeError, ValueError, OverflowError, RuntimeError) as err:
            reason = " ".join(str(err).split())  # numpy's and torch's messages may span lines
            raise TransformFileError(f"{source}: invalid transform file ({type(err).__name__}: {reason})") from None
        return cls(grid, matrix, flows)

    def save(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_dict` as JSON, atomically (temporary file in the same folder, then rename)."""
        return _atomic.write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Transformation:
        """Read a transformation written by :meth:`save` (``transform.json``)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TransformFileError(f"{path}: no such file") from None
        except RecursionError:
            raise TransformFileError(f"{path}: not a regkit transform file (nested too deeply)") from None
        except (OSError, ValueError) as err:  # ValueError: UnicodeDecodeError, JSONDecodeError, over-long integers
            raise TransformFileError(f"{path}: not a readable JSON transform file ({err})") from None
        if not isinstance(data, dict):
            raise TransformFileError(f"{path}: not a regkit transform file")
        return cls.from_dict(data, str(path))
