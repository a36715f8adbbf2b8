"""Time the fused CPAB kernels against the PyTorch factorized path on a CUDA device.

2D 32x32 cells with batch 16 and 3D 8^3 cells with batch 8; 125,000 points per transformation, T = 50, fp32, zero
boundary; forward + backward, best of 5 after one untimed call (which includes Triton's compilation).
Run: ``PYTHONPATH=.:kernels:apps python docs/benchmarks/cpab_triton_h200.py``. Interim, until ``regkit bench cpab``
gets the fused kernels as a column (issue 5).
"""

import functools
import time

import torch

from regkit.cpab.basis import cpa_basis
from regkit.cpab.integrate import integrate
from regkit.cpab.tessellation import Tessellation


def forward_backward(points, theta, weights, basis, backend: str) -> None:
    """One integration of ``points`` through ``theta`` and the backward pass of a random linear loss."""
    theta.grad = None
    out = integrate(points, basis.to_A(theta), basis.tess, steps=50, backend=backend)
    (out * weights).sum().backward()


def seconds(run) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    torch.manual_seed(0)
    for shape, batch in (((32, 32), 16), ((8, 8, 8), 8)):
        basis = cpa_basis(Tessellation(shape))
        theta = (0.5 * torch.randn(batch, basis.d, device="cuda")).requires_grad_(True)
        points = torch.rand(batch, 125_000, len(shape), device="cuda")
        weights = torch.randn_like(points)
        for backend in ("torch", "triton"):
            run = functools.partial(forward_backward, points, theta, weights, basis, backend)
            first = seconds(run)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            best = min(seconds(run) for _ in range(5))
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            print(f"{shape} batch {batch} {backend}: {best * 1e3:.2f} ms, peak {peak:.0f} MiB, first {first:.1f} s")


if __name__ == "__main__":
    main()
