"""First use of the numba CPU kernels: how long ``regkit demo`` spends compiling them.

Runs the demo (``regkit.demo.run_demo`` on the CPU, outputs into a temporary folder) twice, each in a fresh Python
process, both with one new, empty ``NUMBA_CACHE_DIR``: the first run compiles every kernel it calls, the second loads
them from that cache. Prints both runs' wall-clock and CPU seconds, their differences (the compile seconds), the
seconds of numba's own top-level compile events in the first run, and, per dispatcher of the kernel modules of
``regkit_kernels.numba``, how many signatures the first run compiled. Wall-clock seconds grow with the machine's load
(a compile runs on one core); CPU seconds much less: on a shared machine compare those, or run it more than once.

Run from the repository root, in the environment regkit is installed in:
``python benchmarks/scripts/numba_first_use.py``.
"""

import json
import os
import subprocess
import sys
import tempfile
import time


def child() -> None:
    """One demo in this process (``NUMBA_CACHE_DIR`` set by the parent); prints its summary as one JSON line."""
    start = time.perf_counter()
    import numba
    from numba.core import event

    from regkit.demo import run_demo

    class Compiles(event.Listener):
        """Seconds in top-level compiles (a kernel compiles the functions it calls inside its own event)."""

        def __init__(self) -> None:
            self.depth, self.began, self.seconds, self.cpu = 0, (0.0, 0.0), 0.0, 0.0

        def on_start(self, ev: event.Event) -> None:
            if self.depth == 0:
                self.began = (time.perf_counter(), time.process_time())
            self.depth += 1

        def on_end(self, ev: event.Event) -> None:
            self.depth -= 1
            if self.depth == 0:
                self.seconds += time.perf_counter() - self.began[0]
                self.cpu += time.process_time() - self.began[1]

    compiles = Compiles()
    with event.install_listener("numba:compile", compiles), tempfile.TemporaryDirectory() as out:
        result = run_demo(out, device="cpu", quiet=True, overwrite=True)
    from regkit_kernels.numba import cpab, filters, lncc, mi, sampling  # those the demo used are loaded

    signatures = {}
    for module in (cpab, filters, lncc, mi, sampling):
        for attr, value in vars(module).items():
            if isinstance(value, numba.core.registry.CPUDispatcher) and value.signatures:
                signatures[f"{module.__name__}.{attr}"] = len(value.signatures)
    summary = {"seconds": time.perf_counter() - start, "cpu": time.process_time(), "compile": compiles.seconds}
    extra = {"compile_cpu": compiles.cpu, "registration": result["registration_seconds"], "signatures": signatures}
    print(json.dumps({**summary, **extra}))


def run(cache: str) -> dict:
    """:func:`child` in a fresh process with ``NUMBA_CACHE_DIR=cache``; its summary."""
    env = {**os.environ, "NUMBA_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="numba-cache-") as cache:
        first, second = run(cache), run(cache)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for label, r in (("first run (empty cache)", first), ("second run (warm cache)", second)):
        print(f"{label}: {r['seconds']:.1f} s ({r['cpu']:.1f} s CPU), registration {r['registration']:.1f} s")
    wall, cpu = first["seconds"] - second["seconds"], first["cpu"] - second["cpu"]
    print(f"compile seconds (first - second): {wall:.1f} s ({cpu:.1f} s CPU)")
    print(f"numba's compile events in the first run: {first['compile']:.1f} s ({first['compile_cpu']:.1f} s CPU)")
    print(f"signatures compiled: {sum(first['signatures'].values())} in {len(first['signatures'])} dispatchers")
    for name, count in sorted(first["signatures"].items()):
        print(f"  {name}: {count}")


if __name__ == "__main__":
    child() if sys.argv[1:] == ["--child"] else main()
