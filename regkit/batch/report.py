"""What a batch run leaves in its output root for people: ``summary.csv`` (:func:`write_summary`, one row per job
with the :data:`SUMMARY_COLUMNS`) and ``report.html`` (:func:`write_report`: a self-contained page with a sortable
table, QC thumbnails and metric histograms), both written atomically."""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import time
import urllib.parse
from pathlib import Path
from typing import Any

from regkit import _atomic
from regkit.batch.plan import Plan
from regkit.png import encode_png

SUMMARY_COLUMNS = (
    "name",
    "fixed",
    "moving",
    "state",
    "seconds",
    "device",
    "mean_dice_before",
    "mean_dice_after",
    "jacobian_fraction_nonpositive",
    "sdlogj",
    "warnings",
    "error",
)
"""Columns of ``summary.csv``: the manifest's state, runtime (s) and device, and metrics from each ``metrics.json``
(``warnings``: its warnings joined by ``; ``)."""


def summary_rows(plan: Plan, rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per job of ``plan``, in plan order, with the :data:`SUMMARY_COLUMNS`: state, runtime and device from
    the manifest ``rows`` (``pending`` for a job it lacks), metrics from the ``metrics.json`` of done jobs (None where
    absent, e.g. Dice without labels)."""
    table = []
    for job in plan.jobs:
        row = rows.get(job.name, {})
        metrics: dict[str, Any] = {}
        if row.get("state") == "done" and (job.out_dir / "metrics.json").is_file():
            metrics = json.loads((job.out_dir / "metrics.json").read_text())
        labels, jacobian = metrics.get("labels") or {}, metrics.get("jacobian") or {}
        table.append(
            {
                "name": job.name,
                "fixed": job.inputs["fixed"],
                "moving": job.inputs["moving"],
                "state": row.get("state", "pending"),
                "seconds": None if row.get("seconds") is None else round(row["seconds"], 3),
                "device": row.get("device"),
                "mean_dice_before": labels.get("mean_dice_before"),
                "mean_dice_after": labels.get("mean_dice_after"),
                "jacobian_fraction_nonpositive": jacobian.get("fraction_nonpositive"),
                "sdlogj": jacobian.get("sdlogj"),
                "warnings": "; ".join(metrics.get("warnings") or []) or None,
                "error": row.get("error"),
            }
        )
    return table


def write_summary(plan: Plan, rows: dict[str, dict[str, Any]]) -> Path:
    """Write ``summary.csv`` in the output root (atomically): the :func:`summary_rows` of ``plan``."""
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, SUMMARY_COLUMNS)
    writer.writeheader()
    writer.writerows(summary_rows(plan, rows))
    return _atomic.write_text(plan.root / "summary.csv", buffer.getvalue())


# --- report.html -----------------------------------------------------------------------------------------------------

REPORT = "report.html"
_THUMBNAIL_SIDE = 240  # pixels: the longest side of a QC thumbnail in the report

_REPORT_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; margin-bottom: 0.2em; }
.meta { color: #555; margin-top: 0; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; margin: 1em 0; }
figure { margin: 0; border: 1px solid #ddd; padding: 0.5em; }
figcaption { font-weight: 600; font-size: 0.9em; }
svg text { font: 11px system-ui, sans-serif; fill: #444; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.5em; vertical-align: top; text-align: left; }
th { background: #f3f3f3; cursor: pointer; user-select: none; position: sticky; top: 0; }
th[data-dir="asc"]::after { content: " \\25B2"; }
th[data-dir="desc"]::after { content: " \\25BC"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td small { color: #666; }
tr.failed td { background: #fdecec; }
tr.pending td, tr.running td { background: #fff8e0; }
td.error { max-width: 30em; font-size: 0.9em; }
img { display: block; image-rendering: auto; }
"""

# Click a header to sort by it (again: the other way); numbers numerically, text alphabetically, empty cells last.
_REPORT_JS = """
for (const th of document.querySelectorAll("#jobs thead th")) {
  th.addEventListener("click", () => {
    const table = th.closest("table"), body = table.tBodies[0], col = th.cellIndex;
    const numeric = th.dataset.type === "num", dir = th.dataset.dir === "asc" ? -1 : 1;
    for (const other of table.tHead.rows[0].cells) delete other.dataset.dir;
    th.dataset.dir = dir === 1 ? "asc" : "desc";
    const key = (row) => row.cells[col].dataset.value ?? row.cells[col].textContent.trim();
    const rows = Array.from(body.rows).sort((a, b) => {
      const x = key(a), y = key(b);
      if (x === "" || y === "") return (x === "") - (y === "");
      return dir * (numeric ? parseFloat(x) - parseFloat(y) : x.localeCompare(y));
    });
    for (const row of rows) body.appendChild(row);
  });
}
"""


def relative_url(path: str) -> str:
    """A URL for the report's folder-relative POSIX ``path``: every segment percent-encoded (``:`` too) behind
    ``./``, so that no file name can become a scheme (``javascript:``), a query or another host."""
    return "./" + urllib.parse.quote(path, safe="/")


def _thumbnail(path: Path) -> str | None:
    """The picture at ``path`` (a job's ``qc.png``) shrunk by block averaging to at most :data:`_THUMBNAIL_SIDE`
    pixels on its longest side, as a ``data:image/png;base64`` URI; None if it is missing or unreadable."""
    import numpy as np
    import SimpleITK as sitk

    if not path.is_file():
        return None
    try:
        rgb = sitk.GetArrayFromImage(sitk.ReadImage(str(path)))
    except RuntimeError:
        return None
    if rgb.ndim == 2:
        rgb = rgb[..., None]
    rgb = np.broadcast_to(rgb[..., :3], (*rgb.shape[:2], 3)).astype(np.float64)
    k = max(1, math.ceil(max(rgb.shape[:2]) / _THUMBNAIL_SIDE))
    h, w = max(k, rgb.shape[0] // k * k), max(k, rgb.shape[1] // k * k)
    rgb = np.pad(rgb, ((0, max(0, h - rgb.shape[0])), (0, max(0, w - rgb.shape[1])), (0, 0)))[:h, :w]
    small = rgb.reshape(h // k, k, w // k, k, 3).mean(axis=(1, 3)).round().clip(0, 255).astype(np.uint8)
    return "data:image/png;base64," + base64.b64encode(encode_png(np.ascontiguousarray(small))).decode("ascii")


def _histogram_svg(title: str, values: list[float], unit: str = "") -> str:
    """A histogram of ``values`` as an inline SVG figure with its title, count and median (or a note if empty)."""
    import numpy as np

    caption = f"<figcaption>{html.escape(title)}</figcaption>"
    if not values:
        return f'<figure>{caption}<p class="meta">no values</p></figure>'
    width, height, left, right, top, bottom = 320, 170, 34, 10, 10, 34
    lo, hi = min(values), max(values)
    if hi == lo:
        pad = abs(lo) * 0.05 or 0.5
        lo, hi = lo - pad, hi + pad
    counts, edges = np.histogram(values, bins=max(1, min(20, math.ceil(math.sqrt(len(values))))), range=(lo, hi))
    plot_w, plot_h = width - left - right, height - top - bottom
    bar_w, top_count = plot_w / len(counts), int(counts.max())
    parts = [f'<svg width="{width}" height="{height}" role="img">']
    for i, count in enumerate(counts):
        bar_h = plot_h * count / top_count
        x, y = left + i * bar_w, top + plot_h - bar_h
        parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(bar_w - 1, 1):.1f}" height="{bar_h:.1f}" fill="#4a7bb7">'
            f"<title>{edges[i]:.4g} to {edges[i + 1]:.4g}{unit}: {count}</title></rect>"
        )
    axis_y = top + plot_h
    parts += [
        f'<line x1="{left}" y1="{axis_y}" x2="{left + plot_w}" y2="{axis_y}" stroke="#888"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{axis_y}" stroke="#888"/>',
        f'<text x="{left - 4}" y="{top + 9}" text-anchor="end">{top_count}</text>',
        f'<text x="{left - 4}" y="{axis_y}" text-anchor="end">0</text>',
        f'<text x="{left}" y="{axis_y + 14}">{lo:.4g}</text>',
        f'<text x="{left + plot_w}" y="{axis_y + 14}" text-anchor="end">{hi:.4g}</text>',
        f'<text x="{left + plot_w / 2}" y="{axis_y + 28}" text-anchor="middle">'
        f"{html.escape(unit.strip() or 'value')}; n = {len(values)}, median {float(np.median(values)):.4g}</text>",
        "</svg>",
    ]
    return f"<figure>{caption}{''.join(parts)}</figure>"


def _cell(value: Any, digits: int | None = None, scale: float = 1.0, css: str = "") -> str:
    """A table cell: numbers (times ``scale``) right-aligned with ``digits`` significant digits and sorted by their
    full value, text escaped; None is an empty cell. ``css``: the cell's class."""
    if value is None or value == "":
        return '<td data-value=""></td>'
    if digits is not None:
        number = float(value) * scale
        return f'<td class="num" data-value="{number!r}">{number:.{digits}g}</td>'
    return f'<td class="{css}">{html.escape(str(value))}</td>' if css else f"<td>{html.escape(str(value))}</td>"


def write_report(plan: Plan, rows: dict[str, dict[str, Any]]) -> Path:
    """Write ``report.html`` in the output root (atomically): a self-contained page (inline CSS, JavaScript and
    images; no network) with histograms (inline SVG) of the done jobs' mean Dice before and after, folds and runtime,
    and a table of every job of ``plan`` (:func:`summary_rows`) sortable by any column, with each done job's QC
    thumbnail (from its ``qc.png``, linked to the full picture)."""
    table = summary_rows(plan, rows)
    done = [row for row in table if row["state"] == "done"]

    def values(key: str, scale: float = 1.0) -> list[float]:
        return [row[key] * scale for row in done if row[key] is not None]

    states = {state: sum(row["state"] == state for row in table) for state in ("done", "failed", "running", "pending")}
    counts = ", ".join(f"{n} {state}" for state, n in states.items() if n)
    plots = [
        _histogram_svg("Mean Dice before", values("mean_dice_before")),
        _histogram_svg("Mean Dice after", values("mean_dice_after")),
        _histogram_svg("Folds (non-positive Jacobian)", values("jacobian_fraction_nonpositive", 100.0), " %"),
        _histogram_svg("Runtime", values("seconds"), " s"),
    ]
    header = [
        ("#", "num"),
        ("job", "text"),
        ("QC", "text"),
        ("state", "text"),
        ("runtime s", "num"),
        ("device", "text"),
        ("Dice before", "num"),
        ("Dice after", "num"),
        ("folds %", "num"),
        ("SDlogJ", "num"),
        ("warnings", "text"),
        ("error", "text"),
    ]
    body = []
    for index, (job, row) in enumerate(zip(plan.jobs, table, strict=True)):
        thumbnail = _thumbnail(job.out_dir / "qc.png") if row["state"] == "done" else None
        qc = '<td data-value=""></td>'
        if thumbnail is not None:
            link = html.escape(relative_url(f"{job.name}/qc.png"), quote=True)
            alt = html.escape(f"QC of {job.name}", quote=True)
            qc = f'<td data-value="{index}"><a href="{link}"><img src="{thumbnail}" alt="{alt}"></a></td>'
        fixed, moving = job.inputs["fixed"], job.inputs["moving"]
        assert fixed is not None and moving is not None
        title = html.escape(f"fixed {fixed}\nmoving {moving}", quote=True)
        body.append(
            f'<tr class="{html.escape(row["state"])}"><td class="num" data-value="{index}">{index}</td>'
            f'<td data-value="{html.escape(job.name, quote=True)}" title="{title}">{html.escape(job.name)}<br>'
            f"<small>{html.escape(moving.name)} to {html.escape(fixed.name)}</small></td>"
            f"{qc}{_cell(row['state'])}{_cell(row['seconds'], 4)}{_cell(row['device'])}"
            f"{_cell(row['mean_dice_before'], 3)}{_cell(row['mean_dice_after'], 3)}"
            f"{_cell(row['jacobian_fraction_nonpositive'], 3, 100.0)}{_cell(row['sdlogj'], 3)}"
            f"{_cell(row['warnings'], css='error')}{_cell(row['error'], css='error')}</tr>"
        )
    title = f"regkit batch: {plan.root}"
    page = "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            '<head><meta charset="utf-8">',
            f"<title>{html.escape(title)}</title>",
            f"<style>{_REPORT_CSS}</style></head>",
            "<body>",
            f"<h1>{html.escape(title)}</h1>",
            f'<p class="meta">spec {html.escape(str(plan.spec_path))}; {len(table)} jobs: {counts}; '
            f"written {time.strftime('%Y-%m-%d %H:%M:%S')}</p>",
            f'<section class="plots">{"".join(plots)}</section>',
            '<table id="jobs"><thead><tr>'
            + "".join(f'<th data-type="{kind}">{html.escape(name)}</th>' for name, kind in header)
            + "</tr></thead>",
            "<tbody>",
            *body,
            "</tbody></table>",
            f"<script>{_REPORT_JS}</script>",
            "</body></html>",
            "",
        ]
    )
    return _atomic.write_text(plan.root / REPORT, page)
