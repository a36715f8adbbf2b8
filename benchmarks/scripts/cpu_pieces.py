"""The CPU kernels behind a 2 mm brain registration, timed one by one, and their share of a whole registration.

Run from the repository root (``regkit`` and ``kernels`` importable: the dev venv, or ``PYTHONPATH``), on a machine with
nothing else running::

    PYTHONPATH=. python benchmarks/scripts/cpu_pieces.py [--threads 2]

Prints, in ms (best of 10, wall clock): box sums of 6 channels of the 2 mm MNI grid (95 x 117 x 99, window 5), the
local NCC's forward and backward there, the CPAB step matrices and their adjoint at 8^3, 16^3 and 24^3 cells (theta ~
0.3 N(0, 1), every cell with a gradient), the CPAB integration forward and backward of the grid's points (24^3 cells,
2 steps); then the seconds each numba kernel takes inside the second of two registrations (``accuracy-3d-mi`` on the
``contrast`` pair 0 and ``accuracy-3d-lncc`` on ``2mm`` pair 0, as ``python -m benchmarks accuracy`` builds them), in a
process set up as the ``regkit`` command sets up its own (``regkit.process.configure_process``).
"""

import argparse
import collections
import os
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the regkit command's setting, before torch is imported

import torch

from benchmarks.accuracy import CONFIGS
from benchmarks.accuracy_pairs import make_pairs
from regkit.config import load_config
from regkit.cpab import CPAB
from regkit.process import configure_process
from regkit.registration import register
from regkit.spatial.grid import Grid
from regkit_kernels.numba import cpab as cpab_numba
from regkit_kernels.numba import filters as filters_numba
from regkit_kernels.numba import lncc as lncc_numba
from regkit_kernels.numba import mi as mi_numba

SHAPE = (95, 117, 99)  # [z, y, x] of the 2 mm MNI grid


def best_ms(fn, reps: int = 10) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def cpab_line(grid: Grid, cells: int) -> str:
    """Step matrices and their adjoint at ``cells``^3, and at 24^3 the integration of the grid's points."""
    flow = CPAB.for_grid(grid, (cells,) * 3, boundary="zero", steps=2, length_scale=0.05, variance=1.0)
    with torch.no_grad():
        flow.theta.normal_(0, 0.3)
    A = flow.cell_matrices().detach()[None]
    grad_E = torch.randn(*A.shape)
    E = cpab_numba.step_matrices(A, 0.5)
    line = f"{cells}^3 cells ({A.shape[1]}): step matrices {best_ms(lambda: cpab_numba.step_matrices(A, 0.5)):.1f} ms"
    line += f", their adjoint {best_ms(lambda: cpab_numba.step_matrices_vjp(A, 0.5, grad_E)):.1f} ms"
    if cells != 24:
        return line
    points = flow.world_to_domain(grid.world_points()).reshape(1, -1, 3).contiguous()
    grad = torch.randn_like(points)
    forward = best_ms(lambda: cpab_numba.integrate_forward(points, A, E, flow.tess, 0.5, 2))
    backward = best_ms(lambda: cpab_numba.integrate_backward(points, A, E, flow.tess, 0.5, 2, grad, True))
    return line + f"; integration forward {forward:.1f} ms, backward {backward:.1f} ms"


def kernels() -> None:
    torch.manual_seed(0)
    six = torch.randn(6, 1, *SHAPE)
    print(f"box sums, 6 channels, window 5: {best_ms(lambda: filters_numba.box_sums(six, (5, 5, 5))):.1f} ms")
    f, g, w = torch.randn(1, 1, *SHAPE), torch.randn(1, 1, *SHAPE), torch.ones(1, 1, *SHAPE)
    cc2, stats = lncc_numba.local_cc2(f, g, w, (5, 5, 5), 1e-5)
    forward = best_ms(lambda: lncc_numba.local_cc2(f, g, w, (5, 5, 5), 1e-5))
    backward = best_ms(lambda: lncc_numba.local_cc2_backward(f, g, w, stats, cc2, (5, 5, 5), 1e-5, False))
    print(f"local NCC, window 5: forward {forward:.1f} ms, backward {backward:.1f} ms")
    grid = Grid.create(SHAPE[::-1], (2.0, 2.0, 2.0))
    for cells in (8, 16, 24):
        print(cpab_line(grid, cells))


def timed(module: Any, name: str, spent: dict[str, float]) -> None:
    """Replace ``module.name`` by a wrapper adding its wall time to ``spent["<module>.<name>"]``."""
    original = getattr(module, name)
    key = f"{module.__name__.split('.')[-1]}.{name}"

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = original(*args, **kwargs)
        spent[key] += time.perf_counter() - start
        return result

    setattr(module, name, wrapper)


def shares() -> None:
    spent: dict[str, float] = collections.defaultdict(float)
    for name in ("step_matrices", "step_matrices_vjp", "integrate_forward", "integrate_backward"):
        timed(cpab_numba, name, spent)
    for name in ("local_cc2", "local_cc2_backward"):
        timed(lncc_numba, name, spent)
    for name in ("joint_histogram", "joint_histogram_backward"):
        timed(mi_numba, name, spent)
    for preset, pair_set in (("accuracy-3d-mi", "contrast"), ("accuracy-3d-lncc", "2mm")):
        pair = make_pairs(pair_set, 1, 0)[0]
        config = load_config(CONFIGS / f"{preset}.yaml")
        register(pair.fixed, pair.moving, config, device="cpu")  # warm-up: first calls load the kernels
        spent.clear()
        start = time.perf_counter()
        register(pair.fixed, pair.moving, config, device="cpu")
        total = time.perf_counter() - start
        parts = ", ".join(f"{key} {seconds:.2f}" for key, seconds in sorted(spent.items(), key=lambda kv: -kv[1]))
        print(f"{preset} on {pair_set}-0: {total:.2f} s in all; {parts} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    configure_process()  # the regkit command's process settings (heap reuse, cache folders)
    torch.set_num_threads(parser.parse_args().threads)
    kernels()
    shares()


if __name__ == "__main__":
    main()
