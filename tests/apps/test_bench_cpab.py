"""``regkit bench cpab --quick``: runs in seconds and prints (and writes) the tables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from regkit_cli.main import app


def test_bench_cpab_quick_prints_and_writes_tables(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    result = CliRunner().invoke(app, ["bench", "cpab", "--quick", "--output", str(out)])
    assert result.exit_code == 0, result.output
    for text in ("2D, batch 2", "3D, batch 2", "factorized", "unrolled autograd", "forward sensitivity", "gradient ms"):
        assert text in result.output
    markdown = out.read_text()
    assert "| tessellation | d | method | forward ms | gradient ms | total ms | peak MiB | first s |" in markdown
    assert markdown.count("| 2x2 | 10 |") == 3
    assert "time grows with N and T" in markdown
    assert "gradient against forward sensitivity: 2D 4x4, batch 2" in markdown
    assert markdown.count("forward sensitivity |") == 2 + 1 + 1  # the 2D and 3D tables' rows and the comparison's


def test_bench_help_does_not_import_torch() -> None:
    code = "import sys; from regkit_cli.main import app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
