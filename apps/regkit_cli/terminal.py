"""What ``regkit register`` shows on the terminal: a progress bar per stage and pyramid level, the summary lines."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import TaskID

    from regkit.registration import Progress as RegistrationProgress


class RegistrationBar:
    """Per-iteration progress of a registration on stderr: one bar per stage and pyramid level."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("similarity {task.fields[similarity]:.5f}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self.task: TaskID | None = None
        self.key: tuple[int, int] | None = None

    def __enter__(self) -> RegistrationBar:
        self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._finish()
        self.bars.stop()

    def _finish(self) -> None:
        if self.task is not None:  # a level that stopped early: show it complete
            self.bars.update(self.task, total=self.bars.tasks[-1].completed)

    def __call__(self, p: RegistrationProgress) -> None:
        if self.task is None or self.key != (p.stage, p.level):
            self._finish()
            cells = f" {'x'.join(map(str, p.cells))} cells" if p.cells else ""
            description = f"stage {p.stage + 1}/{p.n_stages} {p.kind:<6} level {p.level + 1}/{p.n_levels}{cells}"
            self.task = self.bars.add_task(description, total=p.max_iterations, similarity=p.similarity)
            self.key = (p.stage, p.level)
        self.bars.update(self.task, completed=p.iteration, similarity=p.similarity)


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_lines(out: Path, metrics: dict) -> list[str]:
    """The key metrics of ``metrics.json`` as short lines for the terminal."""
    lines = [f"outputs: {out}"]
    for index, stage in enumerate(metrics["runtime"]["stages"]):
        if stage.get("note"):
            lines.append(f"stage {index} ({stage['kind']}): {stage['note']}")
    for name, values in metrics["similarity"].items():
        before, after = _num(values["before"], ".4g"), _num(values["after"], ".4g")
        lines.append(f"similarity {name} (loss, lower is better): {before} -> {after}")
    labels = metrics.get("labels")
    if labels and labels["mean_dice_after"] is not None:
        hd95 = labels["mean_hd95_after_mm"]
        lines.append(
            f"Dice (mean of {len(labels['labels'])} labels): {_num(labels['mean_dice_before'], '.3f')} -> "
            f"{labels['mean_dice_after']:.3f}; HD95 {_num(hd95, '.2f')} mm"
        )
    jac = metrics["jacobian"]
    if jac["fraction_nonpositive"] is not None:
        lines.append(
            f"Jacobian: {jac['fraction_nonpositive']:.2g} non-positive, SDlogJ {_num(jac['sdlogj'], '.3f')}, "
            f"analytic det in [{_num(jac['analytic_min'], '.3f')}, {_num(jac['analytic_max'], '.3f')}]"
        )
    inv = metrics["invertibility"]
    lines.append(
        f"inverse consistency: max {_num(inv['inverse_consistency_mm']['max'], '.2g')} mm, p99 "
        f"{_num(inv['inverse_consistency_mm']['p99'], '.2g')} mm; points {inv['probe_mm']:g} mm apart map at most "
        f"{_num(inv['largest_jump_mm'], '.2g')} mm apart"
    )
    runtime = metrics["runtime"]
    stages = ", ".join(f"{s['kind']} {s['seconds']:.1f} s" for s in runtime["stages"])
    memory = metrics["peak_memory"]["bytes"]
    peak = f"; peak memory {memory / 2**20:.0f} MiB" if memory else ""
    lines.append(f"runtime: {runtime['total_seconds']:.1f} s ({stages}) on {metrics['device']}{peak}")
    lines += [f"warning: {warning}" for warning in metrics["warnings"]]
    return lines
