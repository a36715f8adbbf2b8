"""How flat the fused CPAB path's cost is in the tessellation size, in GPU time: one forward + backward (``to_A`` on
its auto backend, the integration with checkpoints every 5 steps and without, a weighted sum and its backward)
replayed from a CUDA graph, for 2D tessellations 4x4 ... 32x32 at batch 16 and 3D 2^3 ... 16^3 at batch 8, 125,000
points, T = 50, zero boundary, float32, theta = 0.5 N(0, 1).

On a CUDA machine, from the repository root, in the environment regkit is installed in:
``PYTHONPATH=. python benchmarks/scripts/cpab_flat.py``. Prints one line per case (ms, peak MiB above the
inputs).
"""

import torch

from benchmarks.common import graphed_seconds
from regkit.cpab.basis import CPABasis, cpa_basis
from regkit.cpab.tessellation import Tessellation
from regkit_kernels.cpab import cpab_integrate

T = 50
CASES = [((c, c), 16) for c in (4, 8, 12, 16, 24, 32)] + [((c, c, c), 8) for c in (2, 4, 8, 12, 16)]


def measure(basis: CPABasis, theta: torch.Tensor, points: torch.Tensor, every: int) -> str:
    """Graphed ms and peak MiB of one forward + backward with checkpoints every ``every`` steps."""
    tess = basis.tess
    weights = torch.randn(*points.shape, device="cuda")

    def run() -> None:
        out = cpab_integrate(points, basis.to_A(theta), tess, t=1.0, steps=T, checkpoint_every=every)
        theta.grad = None
        (out * weights).sum().backward()

    run()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    label = "every 5" if every == 5 else "no checkpoints"
    return f"{label} {1e3 * graphed_seconds(run, 10):.3f} ms / {peak:.1f} MiB;"


def main() -> None:
    for shape, batch in CASES:
        torch.manual_seed(0)
        tess = Tessellation(shape)
        basis = cpa_basis(tess, "zero")
        theta = (0.5 * torch.randn(batch, basis.d, device="cuda")).requires_grad_(True)
        points = torch.rand(125_000, len(shape), device="cuda").expand(batch, -1, -1)
        rows = [measure(basis, theta, points, every) for every in (5, T)]
        print(f"{'x'.join(map(str, shape))} batch {batch} (d = {basis.d}):", *rows, flush=True)


if __name__ == "__main__":
    main()
