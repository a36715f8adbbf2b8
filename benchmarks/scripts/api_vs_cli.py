"""The README's Python snippet against ``regkit register`` on the demo pair: registration seconds of each, every run a
fresh process, the two interleaved so that a drift of the machine's load tilts neither. From the repository root, with
the ``regkit`` command on ``PATH`` (the dev venv)::

    PYTHONPATH=. python benchmarks/scripts/api_vs_cli.py [--rounds 3] [--device cpu] [-o FILE]

Writes the pair once with ``regkit demo``, warms numba's cache with one untimed run of each, then runs ``rounds``
rounds of (CLI, Python, Python with ``REGKIT_PROCESS_SETTINGS=0``: the library without the process settings that the
CLI makes, as a baseline). The CLI's figure is ``runtime.total_seconds`` of its ``metrics.json``, the snippet's is
``result.seconds``: both time ``regkit.register`` alone. The table goes to ``benchmarks/results/api-vs-cli.md`` (or
``-o``), after the header of every benchmark table (:func:`benchmarks.common.header`: the command line, the machine,
the date, the tree's commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, Results

SNIPPET = """
import regkit

fixed, moving = regkit.read_image({fixed!r}), regkit.read_image({moving!r})
result = regkit.register(fixed, moving, regkit.load_config("demo"), device={device!r})
print(result.seconds)
"""


def cli_seconds(inputs: Path, out: Path, device: str) -> float:
    command = ["regkit", "register", str(inputs / "fixed.nii.gz"), str(inputs / "moving.nii.gz"), "-o", str(out)]
    subprocess.run([*command, "-c", "demo", "--device", device, "--overwrite", "--quiet"], check=True)
    return json.loads((out / "metrics.json").read_text())["runtime"]["total_seconds"]


def api_seconds(inputs: Path, device: str, settings: bool = True) -> float:
    code = SNIPPET.format(fixed=str(inputs / "fixed.nii.gz"), moving=str(inputs / "moving.nii.gz"), device=device)
    env = {**os.environ, "REGKIT_PROCESS_SETTINGS": "1" if settings else "0"}
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", "-o", type=Path, default=RESULTS / "api-vs-cli.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        subprocess.run(["regkit", "demo", "-o", str(root / "demo"), "--quiet"], check=True)
        inputs = root / "demo" / "inputs"
        cli_seconds(inputs, root / "warm", args.device)
        api_seconds(inputs, args.device)
        rows = []
        for _ in range(args.rounds):
            cli = cli_seconds(inputs, root / "cli", args.device)
            rows.append((cli, api_seconds(inputs, args.device), api_seconds(inputs, args.device, settings=False)))
    cli, api, bare = (statistics.median(column) for column in zip(*rows, strict=True))
    lines = [
        f"**The README's Python snippet against `regkit register` (demo pair, demo preset, {args.device})**: "
        "registration seconds, each run a fresh process, rounds interleaved.",
        "",
        "| round | CLI s | Python s | Python / CLI | Python without the settings s | / CLI |",
        "|---|---|---|---|---|---|",
        *(f"| {i + 1} | {c:.2f} | {a:.2f} | {a / c:.3f} | {b:.2f} | {b / c:.3f} |" for i, (c, a, b) in enumerate(rows)),
        f"| median | {cli:.2f} | {api:.2f} | {api / cli:.3f} | {bare:.2f} | {bare / cli:.3f} |",
        "",
    ]
    Results(args.output, "cuda" if args.device.startswith("cuda") else "cpu").add(*lines)
    print("\n".join(lines))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
