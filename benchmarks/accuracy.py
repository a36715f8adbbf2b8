"""``python -m benchmarks accuracy``: regkit beside ANTs, elastix, SimpleITK and FireANTs on the same brain pairs.

Pairs come from :mod:`benchmarks.accuracy_pairs` (all offline, deterministic with ``--seed``). Each tool runs in its
own subprocess and its own Python environment (:mod:`benchmarks.accuracy_runners`; never a regkit dependency): ANTs,
elastix and SimpleITK in ``--bench-python``, FireANTs in ``--fireants-python`` (it pins its own SimpleITK), regkit in
this interpreter. A tool whose environment lacks it is reported as ``not installed``.

Every tool hands back its transformation as an ITK displacement field on the fixed grid (LPS mm, pull-back), and the
metrics are computed here, the same way for every tool, with :mod:`regkit.spatial.metrics`:

* Dice: the moving labels sampled (nearest neighbour) at ``x + u(x)``, mean over the labels present in both label
  maps, against the fixed labels; HD95: mean over those labels of the symmetric 95th-percentile surface distance (mm);
* folds and SDlogJ: Learn2Reg's fraction of non-positive Jacobian determinants and SDlogJ, central differences of the
  field over the whole fixed grid (interior ``[2:-2]``);
* EPE (where the truth is known): mean ``|u - u_true|`` (mm) over the fixed image's labelled voxels;
* runtime: the registration call alone, timed inside the runner (``reg s``; image loading and field export excluded;
  on CUDA after one untimed warm-up unless ``--no-warmup``), and the whole subprocess (``wall s``);
* memory: the peak resident set of the tool's process (its ``VmHWM``, read by the runner at its end; the parent's
  ``ru_maxrss`` of a child would include the parent's own resident set at ``fork``), and for torch tools on CUDA
  ``torch.cuda.max_memory_allocated``.

Two reference rows per pair: ``before`` (identity field) and ``truth`` (the true field, where known: the best Dice the
label maps allow). The Dice of the labels the tool warped itself is kept in the CSV (``dice_tool_warp``) as a check
that its field was read in the right convention.

Outputs: the tables in ``--output`` (markdown: the header of :func:`benchmarks.common.header`, the settings, one
table per pair set, then every pair; rewritten after every run), and in the work folder ``--out``: ``pairs/`` (the
generated pairs), ``runs/PAIR/TOOL/`` (each tool's files and log), ``accuracy.csv`` (one row per pair and tool) and
``accuracy.png`` (Dice against runtime per pair set; skipped when matplotlib is missing).
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from benchmarks.accuracy_runners import TOOLS
from benchmarks.common import ITK_DATA, PAIR_SETS, ROOT, Device, MiB, Results, default_output, device_name

if TYPE_CHECKING:
    import torch

    from benchmarks.accuracy_pairs import BenchPair

RUNNER = Path(__file__).with_name("accuracy_runners.py")
CONFIGS = Path(__file__).with_name("configs")  # the regkit tools' configurations, accuracy-{ndim}d-{kind}.yaml
DEFAULT_PAIRS = "2mm,contrast,itk2d,multimodal2d,nibabel"
DEFAULT_TOOLS = "regkit,ants,elastix,sitk,fireants"
HALVES = ("tuning", "held-out", "all")
"""``--half``: a set's pairs at even positions are for tuning settings, those at odd positions are held out."""
REFERENCES = ("before", "truth")
# regkit tool -> similarity kind of its configuration ``benchmarks/configs/accuracy-{ndim}d-{kind}.yaml``; the tool
# ``regkit`` runs the default configuration (``regkit.register`` given none)
_REGKIT_KINDS = {"regkit-lncc": "lncc", "regkit-mi": "mi", "regkit-features": "features"}
_CSV_FIELDS = (
    "pair_set",
    "pair",
    "tool",
    "status",
    "dice",
    "dice_tool_warp",
    "hd95_mm",
    "folds",
    "sdlogj",
    "epe_mm",
    "registration_s",
    "wall_s",
    "peak_rss_mib",
    "gpu_peak_mib",
    "version",
)


@dataclass
class Row:
    """One pair and one tool (or reference): the status and the metrics (NaN where not applicable)."""

    pair_set: str
    pair: str
    tool: str
    status: str = "ok"
    metrics: dict[str, float] = field(default_factory=dict)
    version: str = ""

    def value(self, key: str) -> float:
        return self.metrics.get(key, math.nan)


# ---- metrics ---------------------------------------------------------------------------------------------------------


def evaluate(pair: BenchPair, displacement: torch.Tensor) -> dict[str, float]:
    """Dice, HD95, folds, SDlogJ and (with the truth) EPE of a pull-back displacement ``(*fixed.shape, n)`` LPS mm on
    the pair's fixed grid (module docstring for the definitions)."""
    import numpy as np
    import torch

    from regkit.spatial.metrics import fraction_nonpositive, hd95_per_label, jacobian_determinant, mean_dice, sdlogj
    from regkit.spatial.sampling import sample_image

    grid = pair.fixed.grid
    u = displacement.to(torch.float64)
    warped = sample_image(
        pair.moving_labels.data, pair.moving_labels.grid, grid.world_points(torch.float64) + u, "nearest"
    )
    fixed_labels = pair.fixed_labels.data
    labels = sorted(set(torch.unique(fixed_labels).tolist()) & set(torch.unique(pair.moving_labels.data).tolist()))
    labels = [label for label in labels if label != 0]
    det = jacobian_determinant(u, grid)
    hd95 = list(hd95_per_label(fixed_labels, warped, grid.spacing, labels).values())
    result = {
        "dice": mean_dice(fixed_labels, warped, labels),
        "hd95_mm": float(np.nanmean(hd95)) if not all(math.isnan(v) for v in hd95) else math.nan,
        "folds": fraction_nonpositive(det),
        "sdlogj": sdlogj(det),
    }
    if pair.true_displacement is not None:
        inside = fixed_labels != 0
        error = (u - pair.true_displacement.to(torch.float64)).norm(dim=-1)
        result["epe_mm"] = float(error[inside].mean())
    return result


# ---- running the tools -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Environments:
    """The interpreter of each tool's environment."""

    bench: Path
    fireants: Path

    def python(self, tool: str) -> str:
        if tool.startswith("regkit"):
            return sys.executable
        return str(self.fireants if tool == "fireants" else self.bench)


def _child_env(threads: int) -> dict[str, str]:
    env = os.environ.copy()
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ITK_GLOBAL_DEFAULT_NUMBER_OF_THREADS"):
        env[name] = str(threads)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONUNBUFFERED"] = "1"
    env["TQDM_DISABLE"] = "1"  # FireANTs draws progress bars: keep the logs readable
    return env


def _last_line(path: Path, fallback: str) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:160] if lines else fallback


def run_process(args: list[str], log: Path, env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run ``args`` in the folder of ``log`` (tools that drop files in their working folder, as transformix does, drop
    them there), stdout and stderr into ``log``; ``{"returncode", "wall_s"}``, returncode None when it was killed at
    ``timeout`` seconds."""
    import subprocess

    start = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
    try:
        returncode: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        returncode = None
    return {"returncode": returncode, "wall_s": time.perf_counter() - start}


def probe_tool(tool: str, envs: Environments, env: dict[str, str], folder: Path) -> tuple[str | None, str]:
    """``(version, "")`` if the tool runs in its environment, else ``(None, reason)``."""
    python = envs.python(tool)
    if not Path(python).exists() and os.sep in python:
        return None, f"no interpreter {python}"
    log = folder / f"probe-{tool}.log"
    done = run_process([python, str(RUNNER), "--probe", tool], log, env, timeout=300)
    if done["returncode"] != 0:
        return None, _last_line(log, "probe failed")
    return json.loads(_last_line(log, "{}"))["version"], ""


def _regkit_config(tool: str, ndim: int, overrides: dict[str, str]) -> str | None:
    """The configuration file of a regkit tool; None for ``regkit``, the default configuration."""
    if tool == "regkit":
        return None
    kind = _REGKIT_KINDS[tool]
    return overrides.get(f"{kind}-{ndim}d", str(CONFIGS / f"accuracy-{ndim}d-{kind}.yaml"))


def in_half(position: int, half: str) -> bool:
    """Whether the pair at ``position`` in its set belongs to ``half`` (:data:`HALVES`)."""
    return half == "all" or (position % 2 == 0) == (half == "tuning")


def run_tool(
    tool: str, pair_dir: Path, run_dir: Path, spec_extra: dict[str, Any], envs: Environments, timeout: float
) -> dict[str, Any]:
    """Run one tool on one written pair; returns the runner's ``result.json`` plus ``wall_s``, or
    ``{"failed": reason}``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    info = json.loads((pair_dir / "pair.json").read_text())
    spec = {
        "tool": tool,
        "fixed": str(pair_dir / "fixed.mha"),
        "moving": str(pair_dir / "moving.mha"),
        "moving_labels": str(pair_dir / "moving_labels.mha"),
        "out": str(run_dir),
        "modality": info["modality"],
        **spec_extra,
    }
    if tool.startswith("regkit"):
        spec["config"] = _regkit_config(tool, info["ndim"], spec_extra["regkit_configs"])
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    (run_dir / "result.json").unlink(missing_ok=True)
    done = run_process(
        [envs.python(tool), str(RUNNER), str(run_dir / "spec.json")],
        run_dir / "runner.log",
        _child_env(spec["threads"]),
        timeout,
    )
    if done["returncode"] is None:
        return {"failed": f"over {timeout:.0f} s"}
    if done["returncode"] != 0 or not (run_dir / "result.json").is_file():
        return {"failed": _last_line(run_dir / "runner.log", f"exit code {done['returncode']}")}
    result = json.loads((run_dir / "result.json").read_text())
    process = {"wall_s": done["wall_s"]}
    (run_dir / "process.json").write_text(json.dumps(process))
    return {**result, **process}


def _reused(run_dir: Path) -> dict[str, Any] | None:
    """A finished run's results (``--resume``), or None."""
    files = [run_dir / name for name in ("result.json", "process.json", "displacement.mha")]
    if not all(f.is_file() for f in files):
        return None
    return {**json.loads(files[0].read_text()), **json.loads(files[1].read_text())}


def _tool_row(pair: BenchPair, tool: str, run_dir: Path, outcome: dict[str, Any]) -> Row:
    """Evaluate a finished run (the field read from ``run_dir``) into a row."""
    from benchmarks.accuracy_pairs import read_displacement
    from regkit.io import read_image
    from regkit.spatial.metrics import mean_dice

    row = Row(pair.pair_set, pair.name, tool, version=str(outcome.get("version", "")))
    try:
        displacement = read_displacement(run_dir / "displacement.mha", pair.fixed.grid)
    except Exception as err:  # a tool that wrote something unreadable fails its row, not the benchmark
        row.status = f"failed: {err}"[:160]
        return row
    row.metrics = evaluate(pair, displacement)
    warped = read_image(run_dir / "warped_labels.mha", ndim=pair.fixed.ndim).data
    row.metrics["dice_tool_warp"] = mean_dice(pair.fixed_labels.data, warped.to(pair.fixed_labels.data.dtype))
    row.metrics["registration_s"] = float(outcome["seconds"])
    row.metrics["wall_s"] = float(outcome["wall_s"])
    if outcome.get("peak_rss_bytes") is not None:
        row.metrics["peak_rss_mib"] = outcome["peak_rss_bytes"] / MiB
    if outcome.get("gpu_peak_bytes") is not None:
        row.metrics["gpu_peak_mib"] = outcome["gpu_peak_bytes"] / MiB
    return row


def reference_rows(pair: BenchPair) -> list[Row]:
    """The ``before`` (identity) and, where the truth is known, ``truth`` rows of a pair."""
    import torch

    identity = torch.zeros(*pair.fixed.grid.shape, pair.fixed.ndim)
    rows = [Row(pair.pair_set, pair.name, "before", metrics=evaluate(pair, identity))]
    if pair.true_displacement is not None:
        rows.append(Row(pair.pair_set, pair.name, "truth", metrics=evaluate(pair, pair.true_displacement)))
    return rows


# ---- output ----------------------------------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 3) -> str:
    return "" if math.isnan(value) else f"{value:.{digits}f}"


def _fmt_folds(value: float) -> str:
    return "" if math.isnan(value) else ("0" if value == 0 else f"{100 * value:.3g} %")


def write_csv(rows: list[Row], path: Path) -> None:
    """One line per pair and tool (reference rows included); metrics with full precision, empty where missing."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(_CSV_FIELDS)
        for row in rows:
            values = [row.pair_set, row.pair, row.tool, row.status]
            values += [repr(row.value(k)) if not math.isnan(row.value(k)) else "" for k in _CSV_FIELDS[4:-1]]
            writer.writerow([*values, row.version])


def _mean(rows: list[Row], key: str) -> float:
    import numpy as np

    values = [row.value(key) for row in rows if not math.isnan(row.value(key))]
    return float(np.mean(values)) if values else math.nan


def _largest(rows: list[Row], key: str) -> float:
    values = [row.value(key) for row in rows if not math.isnan(row.value(key))]
    return max(values) if values else math.nan


def summary_table(rows: list[Row], pair_set: str, tools: list[str]) -> list[str]:
    """Markdown lines: one row per tool (means over the set's pairs that finished; peak memory: the largest)."""
    header = ["tool", "Dice", "HD95 mm", "folds", "SDlogJ", "EPE mm", "reg s", "wall s", "peak RSS MiB", "GPU MiB"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["--:"] * (len(header) - 1)) + "|"]
    for tool in [*REFERENCES, *tools]:
        mine = [row for row in rows if row.pair_set == pair_set and row.tool == tool]
        if not mine:
            continue
        failed = [row for row in mine if row.status != "ok"]
        if len(failed) == len(mine):
            lines.append(f"| {tool} | {failed[0].status} |" + " |" * (len(header) - 2))
            continue
        name = tool
        if failed:  # means over the pairs that finished; say how many did not
            name = f"{tool} ({len(mine) - len(failed)} of {len(mine)} pairs; {failed[0].status})"
            mine = [row for row in mine if row.status == "ok"]
        peak, gpu = _largest(mine, "peak_rss_mib"), _largest(mine, "gpu_peak_mib")
        cells = [
            name,
            _fmt(_mean(mine, "dice")),
            _fmt(_mean(mine, "hd95_mm"), 2),
            _fmt_folds(_mean(mine, "folds")),
            _fmt(_mean(mine, "sdlogj")),
            _fmt(_mean(mine, "epe_mm"), 2),
            _fmt(_mean(mine, "registration_s"), 1),
            _fmt(_mean(mine, "wall_s"), 1),
            _fmt(peak, 0),
            _fmt(gpu, 0),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def per_pair_table(rows: list[Row]) -> list[str]:
    header = ["pair", "tool", "Dice", "Dice (tool's warp)", "HD95 mm", "folds", "SDlogJ", "EPE mm", "reg s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---", "---"] + ["--:"] * (len(header) - 2)) + "|"]
    for row in rows:
        if row.status != "ok":
            lines.append(f"| {row.pair} | {row.tool} | {row.status} |" + " |" * (len(header) - 3))
            continue
        cells = [
            row.pair,
            row.tool,
            _fmt(row.value("dice")),
            _fmt(row.value("dice_tool_warp")),
            _fmt(row.value("hd95_mm"), 2),
            _fmt_folds(row.value("folds")),
            _fmt(row.value("sdlogj")),
            _fmt(row.value("epe_mm"), 2),
            _fmt(row.value("registration_s"), 1),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_plot(rows: list[Row], pair_sets: list[str], tools: list[str], path: Path) -> bool:
    """Dice against registration time (log scale), one panel per pair set, one marker per tool; the truth's Dice as a
    dashed line. Returns False (and writes nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(pair_sets), figsize=(4.2 * len(pair_sets), 3.6), squeeze=False)
    for ax, pair_set in zip(axes[0], pair_sets, strict=True):
        mine = [row for row in rows if row.pair_set == pair_set and row.status == "ok"]
        for index, tool in enumerate(tools):
            runs = [row for row in mine if row.tool == tool]
            if runs:
                x, y = _mean(runs, "registration_s"), _mean(runs, "dice")
                ax.scatter([x], [y], color=f"C{index}", label=tool, s=40)
                ax.annotate(tool, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        for tool, style in (("truth", "--"), ("before", ":")):
            dice = _mean([row for row in mine if row.tool == tool], "dice")
            if not math.isnan(dice):
                ax.axhline(dice, color="grey", linestyle=style, linewidth=1, label=tool)
        ax.set_xscale("log")
        ax.set_title(pair_set, fontsize=10)
        ax.set_xlabel("registration time (s)")
        ax.set_ylabel("mean Dice")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def markdown_tables(settings: list[str], rows: list[Row], pair_sets: list[str], tools: list[str]) -> list[str]:
    """The settings, one summary table per pair set, then every pair: markdown lines."""
    lines = [*settings, ""]
    for pair_set in pair_sets:
        described = sorted({row.pair for row in rows if row.pair_set == pair_set})
        lines += [f"**{pair_set}** ({len(described)} pair{'s' if len(described) != 1 else ''})", ""]
        lines += [*summary_table(rows, pair_set, tools), ""]
    return [*lines, "**Per pair**", "", *per_pair_table(rows), ""]


# ---- the command -----------------------------------------------------------------------------------------------------


def _choices(value: str, allowed: tuple[str, ...] | list[str], what: str) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in allowed]
    if unknown or not chosen:
        raise typer.BadParameter(f"give {what} from {', '.join(allowed)}, comma-separated (got {value!r})")
    return chosen


def _config_overrides(values: list[str]) -> dict[str, str]:
    overrides = {}
    for value in values:
        key, sep, config = value.partition("=")
        if not sep or key not in {f"{kind}-{n}d" for kind in _REGKIT_KINDS.values() for n in (2, 3)}:
            raise typer.BadParameter(f"expected KIND-NDd=CONFIG such as lncc-3d=my.yaml, got {value!r}")
        overrides[key] = config
    return overrides


def accuracy(
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Markdown file of the tables (default: benchmarks/results/accuracy-MACHINE.md)."
        ),
    ] = None,
    out: Annotated[
        Path, typer.Option("--out", help="Work folder: the pairs, each tool's runs, accuracy.csv and accuracy.png.")
    ] = ROOT / "out" / "accuracy",
    pairs: Annotated[
        str, typer.Option("--pairs", help=f"Comma-separated pair sets: {', '.join(PAIR_SETS)}.")
    ] = DEFAULT_PAIRS,
    tools: Annotated[str, typer.Option("--tools", help=f"Comma-separated tools: {', '.join(TOOLS)}.")] = DEFAULT_TOOLS,
    device: Annotated[Device, typer.Option("--device", help="Device of the torch tools (regkit, FireANTs).")] = (
        Device.cpu
    ),
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random deformations (pairs are deterministic).")] = 0,
    deformations: Annotated[
        int,
        typer.Option(
            "--deformations", min=1, help="Random deformations per deformed pair set (2mm, 1mm, contrast, 2D sets)."
        ),
    ] = 6,
    half: Annotated[
        str,
        typer.Option(
            "--half",
            help="Which pairs of every set: tuning (even positions), held-out (odd positions; the published figures) "
            "or all.",
        ),
    ] = "held-out",
    threads: Annotated[
        int, typer.Option("--threads", min=1, help="CPU threads of every tool (default: all cores).")
    ] = os.cpu_count() or 1,
    bench_python: Annotated[
        Path,
        typer.Option(
            "--bench-python", envvar="REGKIT_BENCH_PYTHON", help="Interpreter of the ANTs, elastix, SimpleITK env."
        ),
    ] = Path("/work/benchenv/bin/python"),
    fireants_python: Annotated[
        Path,
        typer.Option("--fireants-python", envvar="REGKIT_FIREANTS_PYTHON", help="Interpreter of FireANTs' env."),
    ] = Path("/work/fireantsenv/bin/python"),
    regkit_config: Annotated[
        list[str],
        typer.Option(
            "--regkit-config",
            help="Replace a regkit configuration, KIND-NDd=CONFIG (e.g. lncc-3d=my.yaml; default: "
            "benchmarks/configs/accuracy-3d-lncc.yaml etc.).",
        ),
    ] = [],  # noqa: B006 (typer reads the default; it is never mutated)
    mni_data: Annotated[
        Path | None, typer.Option("--mni-data", help="Folder of nilearn's MNI152 files (default: installed nilearn's).")
    ] = None,
    itk_data: Annotated[Path, typer.Option("--itk-data", help="The ITK examples' Data folder.")] = ITK_DATA,
    warmup: Annotated[
        bool, typer.Option("--warmup/--no-warmup", help="On CUDA, one untimed registration before the timed one.")
    ] = True,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds allowed to one tool on one pair.")] = 3600.0,
    resume: Annotated[bool, typer.Option("--resume", help="Reuse the finished runs already in --out.")] = False,
) -> None:
    """Register the same pairs with regkit and the established tools, each in its own environment, and compare Dice,
    HD95, folds, SDlogJ, endpoint error, runtime and memory (markdown in --output, CSV and PNG in --out)."""
    import torch
    from rich.console import Console

    from benchmarks.accuracy_pairs import make_pairs, read_pair, write_pair
    from regkit.config import load_config

    chosen_sets = _choices(pairs, PAIR_SETS, "pair sets")
    if half not in HALVES:
        raise typer.BadParameter(f"choose from {', '.join(HALVES)}", param_hint="--half")
    chosen_tools = _choices(tools, list(TOOLS), "tools")
    overrides = _config_overrides(regkit_config)
    for value in overrides.values():
        load_config(value)  # a bad configuration fails here, not in every run
    if device is Device.cuda and not torch.cuda.is_available():
        raise typer.BadParameter("CUDA is not available here", param_hint="--device")
    console = Console()
    envs = Environments(bench_python, fireants_python)
    out = out.resolve()  # the tools run in their own folders: every path they get is absolute
    out.mkdir(parents=True, exist_ok=True)
    env = _child_env(threads)

    versions: dict[str, str] = {}
    missing: dict[str, str] = {}
    for tool in chosen_tools:
        version, reason = probe_tool(tool, envs, env, out)
        if version is None:
            missing[tool] = reason
            console.print(f"  {tool}: not installed ({reason})", style="yellow")
        else:
            versions[tool] = version
    spec_extra = {
        "threads": threads,
        "device": device.value,
        "seed": seed,
        "warmup": warmup,
        "regkit_configs": overrides,
    }
    torch_device = device_name(device.value)
    settings = [
        f"Torch tools on {torch_device}; ANTs, elastix and SimpleITK on the CPU; {threads} thread(s) per tool; "
        f"seed {seed}, {deformations} deformation(s) per deformed pair set; pairs: the {half} half "
        "(tuning: even positions in a set, held-out: odd).",
        "regkit: the default configuration (what `regkit register` and `regkit.register` run given none).",
        "Versions: " + ", ".join(f"{tool} {version}" for tool, version in versions.items()) + ".",
        "Dice: mean over labels present in both maps (moving labels sampled at x + u(x), nearest); HD95 mm: mean over "
        "labels; folds: fraction of non-positive Jacobian determinants, SDlogJ (Learn2Reg, central differences of "
        "every tool's field); EPE: mean endpoint error over labelled fixed voxels; reg s: the registration call "
        f"alone{' after one warm-up run' if device is Device.cuda and warmup else ''}; wall s: the whole tool "
        "process; peak RSS: the tool process's peak resident set (VmHWM); before/truth: the identity and the "
        "true field.",
    ]
    rows: list[Row] = []
    output = output or default_output("accuracy", device.value)
    report = Results(output, device.value)

    def flush() -> None:
        write_csv(rows, out / "accuracy.csv")
        report.set(*markdown_tables(settings, rows, chosen_sets, chosen_tools))

    for pair_set in chosen_sets:
        console.print(f"{pair_set}: generating pairs ...", style="dim")
        generated_pairs = make_pairs(pair_set, deformations, seed, mni_data=mni_data, itk_data=itk_data)
        for generated in (p for i, p in enumerate(generated_pairs) if in_half(i, half)):
            pair_dir = write_pair(generated, out / "pairs" / generated.name)
            pair = read_pair(pair_dir)  # what the tools read, geometry included
            rows += reference_rows(pair)
            for tool in chosen_tools:
                if tool in missing:
                    rows.append(Row(pair.pair_set, pair.name, tool, status=f"not installed ({missing[tool]})"[:160]))
                    continue
                run_dir = out / "runs" / pair.name / tool
                outcome = _reused(run_dir) if resume else None
                if outcome is None:
                    outcome = run_tool(tool, pair_dir, run_dir, spec_extra, envs, timeout)
                if "failed" in outcome:
                    rows.append(Row(pair.pair_set, pair.name, tool, status=f"failed: {outcome['failed']}"[:160]))
                else:
                    rows.append(_tool_row(pair, tool, run_dir, outcome))
                row = rows[-1]
                console.print(
                    f"  {pair.name:<16} {tool:<14} {row.status if row.status != 'ok' else ''}"
                    f"Dice {_fmt(row.value('dice'))} folds {_fmt_folds(row.value('folds'))} "
                    f"EPE {_fmt(row.value('epe_mm'), 2)} reg {_fmt(row.value('registration_s'), 1)} s"
                )
                flush()
    flush()
    plotted = write_plot(rows, chosen_sets, chosen_tools, out / "accuracy.png")
    console.print(
        f"wrote {output}, {out / 'accuracy.csv'}"
        + (f", {out / 'accuracy.png'}" if plotted else " (no plot: matplotlib is not installed)")
    )
