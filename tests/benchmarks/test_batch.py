"""``python -m benchmarks batch``: the generated pairs, a tiny run (local and 2 dask workers) writing its table, bad
input."""

from __future__ import annotations

import csv
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.__main__ import app
from benchmarks.batch import make_pairs
from regkit.io import read_image
from tests.regkit.batch.batch_cases import TINY_CONFIG


def test_make_pairs_writes_same_shape_pairs_with_labels(tmp_path: Path) -> None:
    pairs_csv = make_pairs(tmp_path, pairs=2, dim=2, size=20)
    with open(pairs_csv, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["moving"] for row in rows] == ["moving_1.nii.gz", "moving_2.nii.gz"]
    fixed = read_image(tmp_path / "fixed.nii.gz")
    assert fixed.grid.size == (20, 20) and fixed.grid.spacing[0] == pytest.approx(fixed.grid.spacing[1])
    for row in rows:
        for key in ("fixed", "moving", "fixed_labels", "moving_labels"):
            image = read_image(tmp_path / row[key])
            assert image.grid == fixed.grid
        assert read_image(tmp_path / row["moving_labels"]).data.max() > 0  # AAL labels inside the slice
    moving = [read_image(tmp_path / row["moving"]).data for row in rows]
    assert not (moving[0] == moving[1]).all()  # a different known warp per pair
    volume = read_image(make_pairs(tmp_path / "3d", pairs=1, dim=3, size=12).with_name("moving_1.nii.gz"))
    assert volume.grid.size == (12, 12, 12)


@pytest.mark.slow  # a whole benchmark run: over 30 s on 2 cores
def test_bench_batch_tiny_2d_run_writes_the_table(tmp_path: Path) -> None:
    pytest.importorskip("dask.distributed")
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    out = tmp_path / "bench.md"
    args = ["batch", "--pairs", "2", "--dim", "2", "--size", "24", "--workers", "2"]
    args += ["--config", str(config), "--output", str(out), "--keep", str(tmp_path / "run")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    markdown = out.read_text()
    assert markdown.startswith(f"# `{shlex.join(['python', '-m', 'benchmarks', *args])}`")
    assert "| setting | wall s | pairs/min | mean job s | mean Dice after | device | failed |" in markdown
    rows = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith(("| local", "| dask"))]
    assert [row[0].strip() for row in rows] == ["local", "dask, 2 workers"]
    for row in rows:
        cells = [cell.strip() for cell in row]
        assert float(cells[2]) > 0 and cells[5] == "cpu" and cells[6] == "0"
    dice = {cells[4].strip() for cells in rows}
    assert len(dice) == 1  # the same outputs whichever executor ran them
    for index in (0, 1):
        assert (tmp_path / "run" / f"out_{index}" / "report.html").is_file()


def test_bench_batch_refuses_bad_worker_counts() -> None:
    result = CliRunner().invoke(app, ["batch", "--workers", "1,0"])
    assert result.exit_code != 0
    assert "give worker counts >= 1" in result.output
