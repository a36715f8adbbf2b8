"""The fused CPAB path piece by piece: where the time of a forward + backward goes.

Run from the repository root: ``PYTHONPATH=.:kernels python benchmarks/scripts/cpab_pieces.py`` on a CUDA machine (times
and accuracy), or with ``TRITON_INTERPRET=1`` on a CPU (accuracy only). Prints:

* accuracy: the fused step matrices and their adjoint (float64 inside) and ``torch.linalg.matrix_exp`` / its autograd
  in float32, each against ``matrix_exp`` in float64 (largest relative error per matrix);
* CUDA: first every kernel variant used below, by the GPU tests and by ``python -m benchmarks cpab`` is compiled, in
  parallel processes that fill Triton's cache; then per case (2D 32x32 batch 16, 3D 8^3 batch 8, 3D 16^3 batch 8,
  125,000 points; the 160 x 192 x 224 registration grid, 16^3; T = 50) the ms of the step matrices and their adjoint, of
  ordering the points (``point_order``), of the forward and backward kernels for two checkpoint spacings on the points
  in their own order and in that order (what scattered reads and programs taking pieces cost), of a forward + backward
  through ``integrate`` (peak MiB above the inputs) and of the same captured in a CUDA graph (the GPU's time without
  the host's launch overhead), best of 10; and the fixed cost of a call (64 points) with a profile of its host time.
"""

import multiprocessing
import os
import time
from collections.abc import Callable

import torch

from benchmarks.common import graphed_seconds
from regkit.cpab.basis import cpa_basis
from regkit.cpab.integrate import integrate, step_matrices, step_matrices_vjp
from regkit.cpab.tessellation import Tessellation
from regkit_kernels.cpab import cpab_bwd, cpab_fwd
from regkit_kernels.cpab import ops as fused_ops
from regkit_kernels.cpab import step_matrices as fused_step_matrices
from regkit_kernels.cpab import step_matrices_vjp as fused_step_matrices_vjp
from regkit_kernels.launch import interpreter_on

CUDA = torch.cuda.is_available() and not interpreter_on()
DEVICE = "cuda" if CUDA else "cpu"
STEPS = 50
REGISTRATION_GRID = (160, 192, 224)


def accuracy() -> None:
    torch.manual_seed(0)
    for n in (2, 3):
        A = (
            torch.randn(200, n, n + 1, dtype=torch.float64)
            * torch.logspace(-3, 2.5, 200, dtype=torch.float64)[:, None, None]
        )
        G, h = torch.randn_like(A), 0.1
        truth_E, truth_V = step_matrices(A, h), step_matrices_vjp(A, h, G)

        def error(x: torch.Tensor, truth: torch.Tensor, n: int = n) -> float:
            x = x.cpu().double()[..., : n + 1]
            return ((x - truth).abs().amax((-1, -2)) / truth.abs().amax((-1, -2))).max().item()

        for dtype in (torch.float32, torch.float64):
            A_, G_ = A.to(dtype=dtype, device=DEVICE), G.to(dtype=dtype, device=DEVICE)
            fused = error(fused_step_matrices(A_, h), truth_E), error(fused_step_matrices_vjp(A_, h, G_), truth_V)
            plain = error(step_matrices(A_, h), truth_E), error(step_matrices_vjp(A_, h, G_), truth_V)
            print(
                f"{n}D {dtype} vs float64 matrix_exp: E fused {fused[0]:.2e}, matrix_exp {plain[0]:.2e}; "
                f"adjoint fused {fused[1]:.2e}, autograd {plain[1]:.2e}",
                flush=True,
            )


def _compile(spec: tuple[int, bool, int, bool, bool]) -> str:
    """Compile one variant (run in a child process): ``(ndim, divide, checkpoint_every, point_grad, sort)``."""
    ndim, divide, every, point_grad, sort = spec
    fused_ops.SORT_MIN = 0
    tess = Tessellation((2,) * ndim, (-1.0,) * ndim, (2.0,) * ndim) if divide else Tessellation((2,) * ndim)
    A = 0.1 * torch.randn(2, tess.n_cells, ndim, ndim + 1, device=DEVICE)
    points = torch.rand(64, ndim, device=DEVICE).expand(2, -1, -1)
    E = fused_step_matrices(A, 0.02)
    order = fused_ops.point_order(points, E, tess, STEPS) if sort else None
    out, checkpoints = cpab_fwd(points, A, E, tess, 0.02, STEPS, every, order)
    grad_out = torch.randn_like(out)
    _, grad_E, _ = cpab_bwd(points, checkpoints, grad_out, A, E, tess, 0.02, STEPS, every, True, point_grad, order)
    fused_step_matrices_vjp(A, 0.02, grad_E)
    if divide and every == 5:  # the float64 step-matrix kernels, for accuracy()
        fused_step_matrices_vjp(A.double(), 0.02, fused_step_matrices(A.double(), 0.02))
    if CUDA:
        torch.cuda.synchronize()
    return f"{spec}"


def warm_up() -> None:
    """Compile the variants that the tests (float32, boxes [-1, 2]: dividing; checkpoints every 5, 8, 50 steps; point
    gradients), the bench (unit boxes; every 5 and 50 steps; no point gradients) and :func:`timings` use, sorted
    (shared points) and not."""
    specs = [(n, True, every, True, sort) for n in (2, 3) for every in (5, 8, 50) for sort in (False, True)]
    specs += [(n, False, every, False, sort) for n in (2, 3) for every in (5, STEPS) for sort in (False, True)]
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(min(len(specs), os.cpu_count() or 1)) as pool:
        done = pool.map(_compile, specs)
    print(f"compiled {len(done)} variants in parallel: {time.perf_counter() - start:.1f} s", flush=True)


def ms(fn: Callable[[], object], reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def graph_ms(fn: Callable[[], object], reps: int = 10) -> float:
    """ms of ``fn`` replayed from a CUDA graph (the GPU's time: no host launch overhead), as the cpab benchmark times
    it."""
    return 1e3 * graphed_seconds(fn, reps)


def timings(shape: tuple[int, ...], batch: int, points: int = 125_000) -> None:
    torch.manual_seed(0)
    tess = Tessellation(shape)
    basis = cpa_basis(tess, "zero")
    theta = (0.5 * torch.randn(batch, basis.d, device="cuda")).requires_grad_(True)
    if points:
        pts = torch.rand(points, len(shape), device="cuda")
        name = f"{'x'.join(map(str, shape))} batch {batch}, {points:,} points"
    else:
        axes = [(torch.arange(s, device="cuda") + 0.5) / s for s in REGISTRATION_GRID]
        pts = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
        name = f"{'x'.join(map(str, shape))} registration grid {'x'.join(map(str, REGISTRATION_GRID))}"
    batched = pts.expand(batch, -1, -1)
    w = torch.randn(batch, *pts.shape, device="cuda")
    A, h = basis.to_A(theta).detach(), 1 / STEPS
    E = fused_step_matrices(A, h)
    G = torch.randn_like(E)
    print(
        f"{name}: step matrices {ms(lambda: fused_step_matrices(A, h)):.3f} ms, their adjoint "
        f"{ms(lambda: fused_step_matrices_vjp(A, h, G)):.3f} ms",
        flush=True,
    )
    fused_ops.POINT_ORDERS.clear()
    sort = ms(lambda: (fused_ops.POINT_ORDERS.clear(), fused_ops.point_order(batched, E, tess, STEPS)))
    order = fused_ops.point_order(batched, E, tess, STEPS)
    print(f"  ordering the points: {sort:.3f} ms" if order is not None else "  points not ordered")
    for kernel_order in (None, order) if order is not None else (None,):
        for every in (5, STEPS):
            _, checkpoints = cpab_fwd(batched, A, E, tess, h, STEPS, every, kernel_order)
            fwd = ms(lambda every=every, o=kernel_order: cpab_fwd(batched, A, E, tess, h, STEPS, every, o))
            bwd = ms(
                lambda c=checkpoints, every=every, o=kernel_order: cpab_bwd(
                    batched, c, w, A, E, tess, h, STEPS, every, True, False, o
                )
            )
            print(
                f"  {'sorted' if kernel_order is not None else 'unsorted'}, checkpoints every {every}: "
                f"forward kernel {fwd:.3f} ms, backward kernel {bwd:.3f} ms",
                flush=True,
            )
    for every in (5, STEPS):

        def whole(every: int = every) -> None:
            out = integrate(pts, basis.to_A(theta), tess, steps=STEPS, backend="triton", checkpoint_every=every)
            theta.grad = None
            (out * w).sum().backward()

        whole()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        best = ms(whole, reps=5)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        try:
            replay = f"{graph_ms(whole):.3f} ms"
        except Exception as error:  # capture not possible: report why
            replay = f"failed ({str(error).splitlines()[0][:80]})"
        print(
            f"  integrate forward + backward, every {every}: {best:.3f} ms (peak {peak:.1f} MiB); CUDA graph {replay}",
            flush=True,
        )


def overhead() -> None:
    """A whole forward + backward on 64 points: the fixed cost per call (host launches, small torch ops)."""
    tess = Tessellation((8, 8))
    basis = cpa_basis(tess, "zero")
    theta = torch.randn(16, basis.d, device="cuda", requires_grad=True)
    pts = torch.rand(64, 2, device="cuda")
    w = torch.randn(16, 64, 2, device="cuda")

    def whole() -> None:
        out = integrate(pts, basis.to_A(theta), tess, steps=STEPS, backend="triton")
        (out * w).sum().backward()

    print(f"fixed cost: forward + backward on 64 points, 2D 8x8, batch 16: {ms(whole):.3f} ms", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        whole()
        torch.cuda.synchronize()
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


if __name__ == "__main__":
    accuracy()
    if CUDA:
        warm_up()
        overhead()
        timings((32, 32), 16)
        timings((8, 8, 8), 8)
        timings((16, 16, 16), 8)
        timings((16, 16, 16), 1, points=0)
