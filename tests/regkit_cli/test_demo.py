"""``regkit demo``: help, a quick run with a tiny configuration (``--config``), refusal of an existing folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import TINY_3D_CONFIG, run_cli


def test_demo_help_names_its_options_without_importing_torch(capsys) -> None:
    assert run_cli(["demo", "--help"]) == 0
    output = capsys.readouterr().out
    for option in ("--output", "--device", "--overwrite", "--quiet", "--config"):
        assert option in output, output
    code = "import sys; from regkit_cli.main import app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_demo_tiny_run_prints_metrics_and_writes_outputs(tmp_path: Path, capfd) -> None:
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_3D_CONFIG)
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
