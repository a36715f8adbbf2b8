"""The fused CPAB path piece by piece, beside the PyTorch pieces it replaces (issue 5's notes).

Run from the repository root: ``PYTHONPATH=.:kernels python docs/benchmarks/cpab_pieces.py`` on a CUDA machine (times
and accuracy), or with ``TRITON_INTERPRET=1`` on a CPU (accuracy only). Prints:

* accuracy: the step matrices and their adjoint, fused kernels (float64 inside) and ``torch.linalg.matrix_exp`` /
  its autograd in float32, each against ``matrix_exp`` in float64 (largest relative error per matrix);
* CUDA, per case (2D 32x32 batch 16, 3D 8^3 batch 8, 3D 16^3 batch 8; 125,000 points, T = 50, checkpoints every 5
  steps): ms of the step matrices and their adjoint (PyTorch and fused), of the forward and backward kernels, and of a
  whole forward + backward through ``integrate`` (triton and torch backends), best of 10; peak MiB of the whole pass.
"""

import os
import time

import torch

from regkit.cpab.basis import cpa_basis
from regkit.cpab.integrate import _step_matrices_vjp, integrate, step_matrices
from regkit.cpab.tessellation import Tessellation
from regkit_kernels.cpab import cpab_bwd, cpab_fwd
from regkit_kernels.cpab import step_matrices as fused_step_matrices
from regkit_kernels.cpab import step_matrices_vjp as fused_step_matrices_vjp

CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEVICE = "cuda" if CUDA else "cpu"


def accuracy() -> None:
    torch.manual_seed(0)
    for n in (2, 3):
        A = (
            torch.randn(200, n, n + 1, dtype=torch.float64)
            * torch.logspace(-3, 2.5, 200, dtype=torch.float64)[:, None, None]
        )
        G, h = torch.randn_like(A), 0.1
        truth_E, truth_V = step_matrices(A, h), _step_matrices_vjp(A, h, G)
        A32, G32 = A.float().to(DEVICE), G.float().to(DEVICE)

        def error(x: torch.Tensor, truth: torch.Tensor, n: int = n) -> float:
            x = x.cpu().double()[..., : n + 1]
            return ((x - truth).abs().amax((-1, -2)) / truth.abs().amax((-1, -2))).max().item()

        fused = error(fused_step_matrices(A32, h), truth_E), error(fused_step_matrices_vjp(A32, h, G32), truth_V)
        plain = error(step_matrices(A32, h), truth_E), error(_step_matrices_vjp(A32, h, G32), truth_V)
        print(
            f"{n}D float32 vs float64: E fused {fused[0]:.2e}, matrix_exp {plain[0]:.2e}; "
            f"adjoint fused {fused[1]:.2e}, autograd {plain[1]:.2e}"
        )


def ms(fn, reps: int = 10) -> float:
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


def timings(shape: tuple[int, ...], batch: int, points: int = 125_000, K: int = 5) -> None:
    torch.manual_seed(0)
    tess = Tessellation(shape)
    basis = cpa_basis(tess, "zero")
    theta = (0.5 * torch.randn(batch, basis.d, device="cuda")).requires_grad_(True)
    pts = torch.rand(batch, points, len(shape), device="cuda")
    w = torch.randn_like(pts)
    A, h = basis.to_A(theta).detach(), 1 / 50
    E = fused_step_matrices(A, h)
    G = torch.randn_like(E)
    _, checkpoints = cpab_fwd(pts, E, tess, 50, K)
    G_plain = G[..., : len(shape) + 1]  # the PyTorch adjoint takes unpadded rows
    print(
        f"{shape} batch {batch}: step matrices torch {ms(lambda: step_matrices(A, h)):.3f} / fused "
        f"{ms(lambda: fused_step_matrices(A, h)):.3f} ms; adjoint torch "
        f"{ms(lambda: _step_matrices_vjp(A, h, G_plain)):.3f} / "
        f"fused {ms(lambda: fused_step_matrices_vjp(A, h, G)):.3f} ms; forward kernel "
        f"{ms(lambda: cpab_fwd(pts, E, tess, 50, K)):.3f} ms; backward kernel "
        f"{ms(lambda: cpab_bwd(pts, checkpoints, w, E, tess, 50, K, True)):.3f} ms",
        flush=True,
    )
    for backend in ("triton", "torch"):

        def whole(backend: str = backend) -> None:
            theta.grad = None
            (
                integrate(pts, basis.to_A(theta), tess, steps=50, backend=backend, checkpoint_every=K) * w
            ).sum().backward()

        whole()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        best = ms(whole, reps=5)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        print(f"  integrate forward + backward, {backend}: {best:.3f} ms, peak {peak:.0f} MiB", flush=True)


if __name__ == "__main__":
    accuracy()
    if CUDA:
        timings((32, 32), 16)
        timings((8, 8, 8), 8)
        timings((16, 16, 16), 8)
