"""``python -m benchmarks registration``: a 2 mm run with a tiny configuration writes the table; bad sizes refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.__main__ import app
from tests.helpers import TINY_3D_CONFIG


@pytest.mark.slow  # a whole benchmark run: over 30 s on 2 cores
def test_bench_registration_2mm_writes_the_table(tmp_path: Path) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_3D_CONFIG)
    out = tmp_path / "bench.md"
    args = ["registration", "--sizes", "2mm", "--config", str(config), "--output", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    markdown = out.read_text()
    assert markdown.startswith(f"# `python -m benchmarks registration --sizes 2mm --config {config} --output {out}`")
    assert "| pair | size | registration s | stages s | peak MiB | Dice before | Dice after | folds |" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| MNI152 2mm | 99x117x95 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert float(cells[6]) > float(cells[5])  # Dice after > before
    assert cells[7] == "0"  # no folds


def test_bench_registration_refuses_unknown_sizes() -> None:
    result = CliRunner().invoke(app, ["registration", "--sizes", "2mm,3mm"])
    assert result.exit_code != 0
    assert "give sizes from 2mm, 1mm" in result.output
