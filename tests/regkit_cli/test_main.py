"""``regkit`` starts without the benchmarks: they live in the checkout's ``benchmarks`` package, not in the CLI."""

from __future__ import annotations

import subprocess
import sys


def test_regkit_imports_no_benchmark_code() -> None:
    code = "import regkit_cli.main, sys; "
    code += "print(sorted(m for m in sys.modules if m.startswith('benchmarks') or '.bench' in m))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
