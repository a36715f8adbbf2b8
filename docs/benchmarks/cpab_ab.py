r"""The fused CPAB kernels of the working tree against a committed version of them (``cpab_old``), on the H200.

Per case (the 160 x 192 x 224 registration grid with 16^3 cells, one transformation; 3D 8^3 and 16^3, batch 8; 2D
32x32, batch 16; 125,000 points; T = 50): that both give bit-equal end points and close gradients, the forward and
backward kernel times (best of 10) for checkpoints every 5 steps and none, old and new (and, on the grid, the new
kernels' launch variants: block size, warps, the backward's register cap), a whole forward + backward through
``cpab_integrate`` (``to_A``, the loss and its backward included) replayed from a CUDA graph and eagerly, with its
peak memory, and the step matrices, their adjoint and ``to_A`` with its backward.

Setup, from the repository root (``COMMIT``: the version to compare with)::

    mkdir -p .scratch/cpab_old/cpab_old && touch .scratch/cpab_old/cpab_old/__init__.py
    cd .scratch/cpab_old/cpab_old
    for f in kernels ops expm; do git show COMMIT:kernels/regkit_kernels/cpab/$f.py > $f.py; done
    sed -i 's/from regkit_kernels.cpab.\(kernels\|expm\) import/from cpab_old.\1 import/' ops.py; cd -

then on the GPU machine (``carry`` ``.scratch/cpab_old`` and the wheels), with ``PYTHONPATH`` holding the repository,
``kernels``, ``apps`` and ``.scratch/cpab_old``: ``COMPILE_ONLY=1 python3 docs/benchmarks/cpab_ab.py`` (every variant,
and the GPU tests' kernels, compiled in parallel processes: ~30 s on 16 cores), then
``SKIP_COMPILE=1 python3 docs/benchmarks/cpab_ab.py``. ``DRY=1`` with ``TRITON_INTERPRET=1``: tiny sizes on the CPU,
no timings (checks that everything runs; minutes).
"""

import multiprocessing
import os
import sys
import time

import cpab_old.ops as old
import cpab_pieces
import torch

import regkit_kernels.cpab.ops as new
from regkit.cpab.basis import cpa_basis
from regkit.cpab.tessellation import Tessellation
from regkit_kernels.cpab import step_matrices, step_matrices_vjp

DRY = os.environ.get("DRY") == "1"
DEV = "cpu" if DRY else "cuda"
T = 50
GRID = (16, 20, 24) if DRY else (160, 192, 224)
VARIANTS = [(128, 4, 96), (128, 4, None), (64, 2, 96)]  # (BLOCK, num_warps, backward's maxnreg); the default first


def use(block: int, warps: int, maxnreg: int | None) -> None:
    new._BLOCK, new._NUM_WARPS, new._MAXNREG = block, warps, maxnreg


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def ms(fn, reps: int = 10) -> float:
    if DRY:
        fn()
        return float("nan")
    return cpab_pieces.ms(fn, reps)


def graph_ms(fn) -> float:
    if DRY:
        fn()
        return float("nan")
    try:
        return cpab_pieces.graph_ms(fn)
    except Exception as error:
        print("graph failed", str(error).splitlines()[0][:100])
        return float("nan")


def case(shape, batch, points):
    torch.manual_seed(0)
    tess = Tessellation(shape)
    basis = cpa_basis(tess, "zero")
    theta = (0.5 * torch.randn(batch, basis.d, device=DEV)).requires_grad_(True)
    if points:
        pts = torch.rand(points, len(shape), device=DEV)
    else:
        axes = [(torch.arange(s, device=DEV) + 0.5) / s for s in GRID]
        pts = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    return tess, basis, theta, pts


def _compile(spec) -> str:
    """Child process: compile one kernel variant by running it on a few points."""
    module, ndim, every, sort, block, warps, maxnreg = spec
    ops = old if module == "old" else new
    if module == "new":
        use(block, warps, maxnreg)
    ops._SORT_MIN = 0
    tess = Tessellation((2,) * ndim)
    A = 0.1 * torch.randn(2 if sort else 1, tess.n_cells, ndim, ndim + 1, device=DEV)
    pts = torch.rand(64, ndim, device=DEV).expand(A.shape[0], -1, -1)
    order = ops.point_order(pts, tess) if sort else None
    E = step_matrices(A, 0.02)
    if module == "old":
        import cpab_old.expm as old_expm

        old_expm.step_matrices_vjp(A, 0.02, old_expm.step_matrices(A, 0.02))
    out, ck = ops.cpab_fwd(pts, E, tess, T, every, order)
    ops.cpab_bwd(pts, ck, torch.randn_like(out), E, tess, T, every, True, False, order)
    sync()
    return str(spec)


def pieces_specs():
    """cpab_pieces.warm_up's variants (the GPU tests' and the bench's)."""
    return [(n, True, every, True, sort) for n in (2, 3) for every in (5, 8, 50) for sort in (False, True)]


def _compile_any(item) -> str:
    kind, spec = item
    return cpab_pieces._compile(spec) if kind == "pieces" else _compile(spec)


def specs():
    out = []
    for module in ("old", "new"):
        for ndim, sort in ((2, True), (3, True), (3, False)):
            for every in (5, T):
                out.append((module, ndim, every, sort, 128, 4, None))
    for block, warps, maxnreg in VARIANTS[1:]:
        for every in (5, T):
            out.append(("new", 3, every, False, block, warps, maxnreg))
    return out


def kernels(name, tess, A, pts, batch, variants) -> None:
    """Forward and backward kernel times, old and new (and the new launch variants)."""
    h = 1 / T
    P = pts.expand(batch, -1, -1)
    w = torch.randn(batch, *pts.shape, device=DEV)
    E = step_matrices(A, h)
    for every in (5, T):  # the new kernels against the committed ones: end points bit-equal, moments close
        results = []
        for ops in (old, new):
            order = ops.point_order(P, tess)
            out, ck = ops.cpab_fwd(P, E, tess, T, every, order)
            results.append((out, ops.cpab_bwd(P, ck, w, E, tess, T, every, True, True, order)))
        (o0, (gp0, gE0)), (o1, (gp1, gE1)) = results
        print(
            f"{name} every {every} check: end points equal {torch.equal(o0, o1)}, dL/dpoints rel "
            f"{((gp1 - gp0).abs().max() / gp0.abs().max()).item():.2e}, dL/dE rel "
            f"{((gE1 - gE0).abs().max() / gE0.abs().max()).item():.2e}",
            flush=True,
        )
    for every in (5, T):
        rows = [("old", old, None)] + [(f"new {v}", new, v) for v in variants]
        for label, ops, variant in rows:
            if variant is not None:
                use(*variant)
            order = ops.point_order(P, tess)
            _, ck = ops.cpab_fwd(P, E, tess, T, every, order)
            fwd = ms(lambda ops=ops, order=order, every=every: ops.cpab_fwd(P, E, tess, T, every, order))
            bwd = ms(
                lambda ops=ops, order=order, ck=ck, every=every: ops.cpab_bwd(
                    P, ck, w, E, tess, T, every, True, False, order
                )
            )
            print(
                f"{name} every {every} {label}: forward kernel {fwd:.3f} ms, backward kernel {bwd:.3f} ms", flush=True
            )
    use(*VARIANTS[0])


def whole(name, tess, basis, theta, pts, batch) -> None:
    """integrate forward + backward (to_A, the loss and its backward included): graphed, eager and peak; old/new."""
    w = torch.randn(batch, *pts.shape, device=DEV)
    P = pts.expand(batch, -1, -1)
    for every in (5, T):
        for label, ops in (("old", old), ("new", new)):

            def run(ops=ops, every=every) -> None:
                out = ops.cpab_integrate(P, basis.to_A(theta), tess, t=1.0, steps=T, checkpoint_every=every)
                theta.grad = None
                (out * w).sum().backward()

            run()
            sync()
            peak = float("nan")
            if not DRY:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            eager = ms(run, reps=10)
            if not DRY:
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            graph = graph_ms(run)
            print(
                f"{name} every {every} {label}: whole GPU (graph) {graph:.3f} ms, eager {eager:.3f} ms, "
                f"peak {peak:.1f} MiB",
                flush=True,
            )


def small_pieces(name, basis, theta) -> None:
    h = 1 / T
    A = basis.to_A(theta).detach()
    G = torch.randn_like(A)
    th = theta.detach().requires_grad_(True)
    g = torch.randn(*A.shape, device=DEV)

    def to_a() -> None:
        (basis.to_A(th) * g).sum().backward()

    import cpab_old.expm as old_expm

    for label, sm, vjp in (
        ("old", old_expm.step_matrices, old_expm.step_matrices_vjp),
        ("new", step_matrices, step_matrices_vjp),
    ):
        print(
            f"{name} {label}: step matrices {graph_ms(lambda sm=sm: sm(A, h)):.3f} ms, adjoint "
            f"{graph_ms(lambda vjp=vjp: vjp(A, h, G)):.3f} ms, to_A + backward {graph_ms(to_a):.3f} ms (graphs)",
            flush=True,
        )


if __name__ == "__main__":
    start = time.perf_counter()
    if DRY:
        for spec in specs():
            _compile(spec)
    elif os.environ.get("SKIP_COMPILE") != "1":
        items = [("ab", s) for s in specs()] + [("pieces", s) for s in pieces_specs()]
        items.sort(key=lambda item: -item[1][1] if item[0] == "ab" else -item[1][0])  # 3D (slowest) first
        with multiprocessing.get_context("spawn").Pool(16) as pool:
            done = pool.map(_compile_any, items)
        print(f"compiled {len(done)} variants (A/B, tests, bench): {time.perf_counter() - start:.1f} s", flush=True)
        if os.environ.get("COMPILE_ONLY") == "1":
            sys.exit(0)
    small = (4, 4, 4) if DRY else (16, 16, 16)
    tess, basis, theta, pts = case(small, 1, 0)
    A = basis.to_A(theta).detach()
    kernels(f"grid {small}", tess, A, pts, 1, VARIANTS)
    whole(f"grid {small}", tess, basis, theta, pts, 1)
    small_pieces(f"grid {small}", basis, theta)
    n = 2000 if DRY else 125_000
    for shape, batch in (((2, 2, 2), 2),) if DRY else (((8, 8, 8), 8), ((16, 16, 16), 8), ((32, 32), 16)):
        tess, basis, theta, pts = case(shape, batch, n)
        A = basis.to_A(theta).detach()
        kernels(f"{shape} B{batch}", tess, A, pts, batch, VARIANTS[:1])
        whole(f"{shape} B{batch}", tess, basis, theta, pts, batch)
        small_pieces(f"{shape} B{batch}", basis, theta)
    if not DRY:
        tess, basis, theta, pts = case((8, 8, 8), 1, 0)
        whole("grid (8, 8, 8)", tess, basis, theta, pts, 1)
    print(f"done in {time.perf_counter() - start:.1f} s", flush=True)
