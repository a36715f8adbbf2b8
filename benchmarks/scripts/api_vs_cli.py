"""The README's Python snippet against ``regkit register`` on the demo pair: registration seconds of each, every run a
fresh process, the two interleaved so that a drift of the machine's load tilts neither.

    python benchmarks/scripts/api_vs_cli.py [--rounds 3] [--device cpu] [--out benchmarks/results/api-vs-cli.md]

Writes the pair once with ``regkit demo``, warms numba's cache with one untimed run of each, then runs ``rounds``
rounds of (CLI, Python, Python with ``REGKIT_PROCESS_SETTINGS=0``: the library without the process settings that the
CLI makes, as a baseline). The CLI's figure is ``runtime.total_seconds`` of its ``metrics.json``, the snippet's is
``result.seconds``: both time ``regkit.register`` alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    parser.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "results" / "api-vs-cli.md")
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
        "# The README's Python snippet against `regkit register` (demo pair, demo preset)",
        "",
        f"`python benchmarks/scripts/api_vs_cli.py --rounds {args.rounds} --device {args.device}`, "
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {platform.system()}, Python {platform.python_version()}; "
        "registration seconds, each run a fresh process, rounds interleaved.",
        "",
        "| round | CLI s | Python s | Python / CLI | Python without the settings s | / CLI |",
        "|---|---|---|---|---|---|",
        *(f"| {i + 1} | {c:.2f} | {a:.2f} | {a / c:.3f} | {b:.2f} | {b / c:.3f} |" for i, (c, a, b) in enumerate(rows)),
        f"| median | {cli:.2f} | {api:.2f} | {api / cli:.3f} | {bare:.2f} | {bare / cli:.3f} |",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
