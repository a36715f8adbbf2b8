"""``python -m benchmarks cpab --quick``: runs in seconds and prints (and writes) the tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from benchmarks.__main__ import app

ROOT = Path(__file__).parents[2]  # the checkout's root, where `benchmarks` imports


@pytest.mark.slow  # a whole benchmark run: over 30 s on 2 cores
def test_bench_cpab_quick_prints_and_writes_tables(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    result = CliRunner().invoke(app, ["cpab", "--quick", "--output", str(out)])
    assert result.exit_code == 0, result.output
    for text in ("2D, batch 2", "3D, batch 2", "factorized", "unrolled autograd", "forward sensitivity", "gradient"):
        assert text in result.output
    markdown = out.read_text()
    header = "| tessellation | d | method | forward ms | gradient ms | total ms | graphed ms | peak MiB | G pt-steps/s"
    assert header in markdown
    assert markdown.count("| 2x2 | 10 |") == 4  # compiled, factorized, unrolled, sensitivity: the CPU methods
    assert "time grows with N and T" in markdown
    assert "gradient against forward sensitivity: 2D 4x4, batch 2" in markdown
    assert markdown.count("forward sensitivity |") == 2 + 1 + 1  # the 2D and 3D tables' rows and the comparison's


def test_bench_cpab_methods_option(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    args = ["cpab", "--quick", "--methods", "factorized", "--output", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    markdown = out.read_text()
    assert markdown.startswith(f"# `python -m benchmarks cpab --quick --methods factorized --output {out}`\n")
    assert "unrolled autograd" not in markdown
    assert markdown.count("forward sensitivity |") == 1  # the comparison's row only
    bad = CliRunner().invoke(app, ["cpab", "--quick", "--methods", "fused"])
    assert bad.exit_code != 0  # the fused methods need CUDA


def test_bench_help_lists_the_commands_without_importing_torch() -> None:
    """From the checkout's root, ``python -m benchmarks --help`` lists every command; the app imports no torch."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    for command in ("cpab", "wtconv", "registration", "features", "accuracy", "batch"):
        assert command in done.stdout
    code = "import sys; from benchmarks.__main__ import app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
