"""What a running registration tells its caller after every iteration (:class:`Progress`), and the error it raises
when the caller asks it to stop (:class:`Cancelled`)."""

from __future__ import annotations

from dataclasses import dataclass

from regkit.errors import RegkitError

__all__ = ["Cancelled", "Progress"]


class Cancelled(RegkitError):
    """The registration was stopped by its ``should_stop`` callback (e.g. a Cancel button or Ctrl-C)."""


@dataclass(frozen=True)
class Progress:
    """One optimizer iteration, reported to the ``progress`` callback."""

    stage: int  # 0-based index into config.stages
    n_stages: int
    kind: str  # stage type: rigid, affine, cpab
    level: int  # 0-based pyramid level (coarse to fine)
    n_levels: int
    iteration: int  # 1-based
    max_iterations: int
    loss: float  # similarity + prior
    similarity: float
    elapsed: float  # seconds since the registration started
    cells: tuple[int, ...] | None = None  # CPAB tessellation at this level
