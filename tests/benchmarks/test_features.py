"""``python -m benchmarks features``: a quick 3D run with the features + lncc columns, both feature distances,
writes its table."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.__main__ import app


@pytest.mark.slow  # a whole benchmark run: over 30 s on 2 cores
def test_bench_features_3d_quick_with_the_lncc_term(tmp_path: Path) -> None:
    out = tmp_path / "features.md"
    args = ["features", "--part", "3d", "--quick", "--cases", "1", "--features-lncc", "1", "--output", out]
    args += ["--distance", "cosine", "--distance", "lncc"]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    markdown = out.read_text()
    assert markdown.startswith(f"# `{shlex.join(['python', '-m', 'benchmarks', *map(str, args)])}`")
    features = "features (warp_image) | features + 1 lncc | "
    features += "features (lncc distance) | features (lncc distance) + 1 lncc"
    assert f"| pair | before | affine only | {features} | mi | lncc |" in markdown
    rows = [line for line in markdown.splitlines() if line.startswith(("| same |", "| inverted |", "| synth |"))]
    assert len(rows) == 3
    for row in rows:
        values = [float(cell) for cell in row.strip("|").split("|")[1:]]
        assert len(values) == 8 and all(0.0 < v <= 1.0 for v in values)
