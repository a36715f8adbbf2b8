"""What the order of the points and the forward kernel's program size cost when steps cross facets.

``PYTHONPATH=.:kernels python benchmarks/scripts/cpab_order.py OUT.md`` on a CUDA machine. Cases: 2D 30^2 batch 16 and
3D 8^3 batch 8 on 125,000 random points, the 160 x 192 x 224 registration grid at 16^3 (batch 1), T = 5, unit-variance
theta (as ``python -m benchmarks cpab``). Per case, the forward and backward kernels' ms (best of 10) with the points
in their own order, sorted by starting cell (``ops.cell_order``) and in ``ops.point_order`` (the cell order grouped by
predicted first crossing step), for forward programs of 32, 64 and 128 points; then the kernels' registers and spills.
"""

import sys
import time
from collections.abc import Callable

import torch

from regkit.cpab.basis import cpa_basis
from regkit.cpab.integrate import count_crossings
from regkit.cpab.tessellation import Tessellation
from regkit_kernels.cpab import cpab_bwd, cpab_fwd, kernels, ops
from regkit_kernels.cpab import step_matrices as fused_step_matrices

GRID = (160, 192, 224)
T = 5
lines: list[str] = []


def say(text: str) -> None:
    print(text, flush=True)
    lines.append(text)


def ms(fn: Callable[[], object], reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def registers(fn: object) -> str:
    found = set()
    for cache in getattr(fn, "device_caches", {}).values():
        for compiled in cache[0].values():
            found.add(f"{getattr(compiled, 'n_regs', '?')} registers, {getattr(compiled, 'n_spills', '?')} spills")
    return "; ".join(sorted(found))


def case(cells: int, ndim: int, batch: int, grid: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    tess = Tessellation((cells,) * ndim)
    basis = cpa_basis(tess, "zero")
    theta = torch.randn(batch, basis.d, generator=gen).cuda()
    if grid:
        axes = [(torch.arange(s) + 0.5) / s for s in GRID]
        pts = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3).cuda()
    else:
        pts = torch.rand(125_000, ndim, generator=gen).cuda()
    A = basis.to_A(theta).detach()
    h = 1.0 / T
    E = fused_step_matrices(A, h)
    x = pts.expand(batch, -1, -1)
    w = torch.randn(batch, *pts.shape, device="cuda")
    sample = pts[:: max(1, len(pts) // 20_000)]
    crossings = count_crossings(sample, A, tess, steps=T) / (batch * len(sample))
    ops.POINT_ORDERS.clear()
    by_cell = ops.cell_order(x, tess)
    order = ops.point_order(x, E, tess, T)
    ordering = ms(lambda: ops.point_order(x, E, tess, T))
    name = "registration grid" if grid else "125,000 points"
    say(f"\n{ndim}D {cells}^{ndim} batch {batch}, {name}, T {T}: {crossings:.2f} crossings per point")
    say(f"  point_order (the cell order cached): {ordering:.3f} ms")
    for block in ((32, 1), (64, 2), (128, 4)):
        ops.FORWARD_BLOCK, ops.FORWARD_WARPS = block
        for label, o in (("own order", None), ("cell order", by_cell), ("point_order", order)):
            _, ck = cpab_fwd(x, A, E, tess, h, T, 5, o)
            f = ms(lambda o=o: cpab_fwd(x, A, E, tess, h, T, 5, o))
            b = ms(lambda o=o, ck=ck: cpab_bwd(x, ck, w, A, E, tess, h, T, 5, True, False, o))
            say(f"  forward programs of {block[0]} points, {label}: forward {f:.3f} ms, backward {b:.3f} ms")
    ops.FORWARD_BLOCK, ops.FORWARD_WARPS = 32, 1
    say(f"  forward kernel: {registers(kernels.cpab_fwd_kernel)}")
    say(f"  backward kernel: {registers(kernels.cpab_bwd_kernel)}")


if __name__ == "__main__":
    for args in ((30, 2, 16, False), (8, 3, 8, False), (16, 3, 1, True)):
        case(*args)
    with open(sys.argv[1], "w") as f:
        f.write(f"# `{' '.join(sys.argv)}`\n\n{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
        f.write("\n".join(lines) + "\n")
