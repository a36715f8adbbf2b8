"""The outcome of :func:`~regkit.registration.register`: :class:`RegistrationResult`, with what every stage
(:class:`StageReport`) and every pyramid level of it (:class:`LevelReport`) did.

``StageReport.to_dict`` is the record of a stage in ``metrics.json`` (``runtime.stages``): ``kind``, ``levels`` (each
``level``, ``iterations``, ``similarity``, ``loss``, ``seconds``, ``cuda_graph`` and, for CPAB levels only,
``cells``) and ``seconds``, in this order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from regkit.config import RegistrationConfig
from regkit.io import Image
from regkit.transform import Transformation

__all__ = ["LevelReport", "RegistrationResult", "StageReport"]


@dataclass(frozen=True)
class LevelReport:
    """What one pyramid level of an optimized stage did."""

    level: int  # 0-based pyramid level (coarse to fine)
    iterations: int  # iterations run (the cap, or fewer when the loss settled)
    similarity: float  # the similarity after the last iteration
    loss: float  # similarity + prior after the last iteration
    seconds: float  # rounded to milliseconds
    cuda_graph: bool  # whether the iterations were replayed from a CUDA graph
    cells: tuple[int, ...] | None = None  # CPAB tessellation at this level; None for rigid and affine stages

    def to_dict(self) -> dict[str, Any]:
        """The level as ``metrics.json`` records it: the fields in order, ``cells`` (a list) only for CPAB levels."""
        record = dataclasses.asdict(self)
        if self.cells is None:
            del record["cells"]
        else:
            record["cells"] = list(self.cells)
        return record


@dataclass
class StageReport:
    """What one stage did: its levels (none for ``moments``) and the seconds spent (rounded to milliseconds)."""

    kind: str
    levels: list[LevelReport] = field(default_factory=list)
    seconds: float = 0.0
    warning: str | None = None  # what went wrong and what was done about it (the stage's result discarded, say)
    similarity: str | None = None  # the similarity the stage optimized (None for moments)
    note: str | None = None  # a choice the stage made and why (the similarity of a multi-modal pair, say)

    def to_dict(self) -> dict[str, Any]:
        """The stage as ``metrics.json`` records it (module docstring)."""
        record: dict[str, Any] = {"kind": self.kind, "levels": [level.to_dict() for level in self.levels]}
        record["seconds"] = self.seconds
        for key in ("similarity", "note", "warning"):
            if getattr(self, key) is not None:
                record[key] = getattr(self, key)
        return record


@dataclass
class RegistrationResult:
    """The outcome of :func:`~regkit.registration.register`: the transformation plus what is needed to write and
    judge it."""

    transform: Transformation
    fixed: Image
    moving: Image
    config: RegistrationConfig
    stages: list[StageReport]
    device: str
    seconds: float
    peak_memory_bytes: int | None  # CUDA: max_memory_allocated; None on the CPU
    fixed_mask: Image | None = None  # the mask the similarity used on the fixed grid, if any

    @property
    def stage_warnings(self) -> list[str]:
        """What the stages reported going wrong, one sentence each (``stage INDEX (KIND): ...``)."""
        return [f"stage {i} ({stage.kind}): {stage.warning}" for i, stage in enumerate(self.stages) if stage.warning]

    def warp(self, image: Image, mode: str = "linear") -> Image:
        """Resample ``image`` (in the moving image's world space, any grid) onto the fixed grid."""
        data = image.data.to(self.device)
        warped = self.transform.warp(data, image.grid, mode=mode).cpu()
        return Image(warped, self.fixed.grid)
