"""``benchmarks.common``: the header every results file starts with (command line, machine, date, tree's commit),
the results file, its default path."""

from __future__ import annotations

import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from benchmarks import common


def test_header_gives_command_machine_date_and_commit() -> None:
    text = common.header("cpu", "python -m benchmarks cpab --device cpu")
    lines = text.splitlines()
    assert lines[0] == "# `python -m benchmarks cpab --device cpu`"
    machine = next(line for line in lines if line.startswith("- machine: "))
    assert f"torch on {torch.get_num_threads()} thread" in machine
    assert f"torch {torch.__version__}" in machine and "triton " in machine
    date = next(line for line in lines if line.startswith("- date: "))
    when = datetime.strptime(date, "- date: %Y-%m-%d %H:%M UTC").replace(tzinfo=timezone.utc)
    assert abs((datetime.now(timezone.utc) - when).total_seconds()) < 120
    tree = next(line for line in lines if line.startswith("- tree: "))
    head = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=common.ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert re.fullmatch(rf"- tree: {head}( \+ changes)?", tree)


def test_the_commit_comes_from_the_environment_without_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(common.COMMIT_VARIABLE, "0123456789ab + changes")
    assert common.tree_commit(tmp_path) == "0123456789ab + changes"  # tmp_path is no git checkout
    monkeypatch.delenv(common.COMMIT_VARIABLE)
    assert common.tree_commit(tmp_path).startswith("unknown")


def test_the_command_line_is_the_one_typed(tmp_path: Path) -> None:
    """A command run through the app records its arguments as given, quoted for a shell."""
    from typer.testing import CliRunner

    from benchmarks.__main__ import app

    out = tmp_path / "a b.md"
    result = CliRunner().invoke(app, ["cpab", "--quick", "--methods", "nonesuch", "-o", str(out)])
    assert result.exit_code != 0  # refused before anything runs or is written
    assert not out.exists()
    assert common.command_line() == f"python -m benchmarks cpab --quick --methods nonesuch -o '{out}'"


def test_results_file_has_the_header_and_is_rewritten_per_section(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "table.md"
    report = common.Results(path, "cpu", "python -m benchmarks x")
    assert path.read_text().startswith("# `python -m benchmarks x`\n")
    report.add("**one**", "")
    report.add("**two**")
    assert path.read_text().endswith("**one**\n\n**two**")
    report.set("**three**")
    assert "**one**" not in path.read_text() and path.read_text().endswith("**three**")


def test_default_output_is_named_by_command_and_machine() -> None:
    assert common.default_output("cpab", "cpu") == common.RESULTS / "cpab-cpu.md"
    assert common.default_output("wtconv", "cpu", quick=True) == common.RESULTS / "wtconv-cpu-quick.md"
    assert common.RESULTS == Path(common.__file__).parent / "results"
