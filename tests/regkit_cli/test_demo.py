"""``regkit demo``: help, a quick run with a tiny configuration (``--config``), refusal of an existing folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from regkit_cli.main import app
from tests.regkit_cli.cli import run_cli

# A few iterations at shrink 4: the whole pipeline (pair, registration, outputs) in seconds, not the demo's accuracy.
TINY_CONFIG = """\
dim: 3
stages:
  - {type: moments}
  - type: affine
    similarity: {name: ncc}
    pyramid: [{shrink: 4, smoothing: 2.0}]
    optimizer: {learning_rate: 0.5, iterations: 10}
  - type: cpab
    similarity: {name: lncc, window: 5}
    pyramid: [{shrink: 4, smoothing: 2.0}]
    optimizer: {learning_rate: 0.05, iterations: 5}
    tessellation: [4]
    steps: 5
"""


def test_demo_help_names_its_options_without_importing_torch() -> None:
    result = CliRunner().invoke(app, ["demo", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--output", "--device", "--overwrite", "--quiet", "--config"):
        assert option in result.output
    code = "import sys; from regkit_cli.main import app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_demo_tiny_run_prints_metrics_and_writes_outputs(tmp_path: Path, capfd) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    out = tmp_path / "demo"
    assert run_cli(["demo", "-o", str(out), "--config", str(config)]) == 0
    printed = capfd.readouterr().out
    for text in ("Dice, mean over 116 AAL labels", "Folds", "Runtime: registration", f"Outputs: {out}"):
        assert text in printed
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["labels"]["mean_dice_after"] > metrics["labels"]["mean_dice_before"]
    assert sorted(p.name for p in (out / "inputs").iterdir()) == [
        "fixed.nii.gz",
        "fixed_labels.nii.gz",
        "moving.nii.gz",
        "moving_labels.nii.gz",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind

    # An existing folder is refused at once (one error line), then replaced with --overwrite, quietly.
    assert run_cli(["demo", "-o", str(out), "--config", str(config)]) == 1
    assert "exists; use --overwrite" in capfd.readouterr().err
    assert run_cli(["demo", "-o", str(out), "--config", str(config), "--overwrite", "--quiet"]) == 0
    assert capfd.readouterr().out == ""
    assert (out / "inputs" / "moving.nii.gz").is_file()
