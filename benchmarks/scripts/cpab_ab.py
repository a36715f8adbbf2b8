r"""The fused CPAB kernels of the working tree against a committed version of them (``cpab_old``), on the H200.

Per case (the 160 x 192 x 224 registration grid with 16^3 cells, one transformation; 3D 8^3 and 16^3, batch 8; 2D
32x32, batch 16; 125,000 points; T = 50): that the old and new kernels give bit-equal end points and close gradients;
the forward and backward kernel times (best of 10) for checkpoints every 5 steps and none, old and new, and on the grid
the new kernels' variants (``VARIANTS``: the backward's programs of 4 warps without the program-wide flush skip, its
register cap; session 5 also ran cell-change records, in commit 776adb7's version of this script), each checked
against the old kernels; a whole forward + backward through ``cpab_integrate`` (the basis map ``to_A``, the loss and
its backward included) with the fastest variant, replayed from a CUDA graph and eagerly, with its peak memory, with
``CPABasis.to_A`` and with the fused ``cell_velocities``; and the step matrices, their adjoint and ``to_A`` with its
backward, PyTorch's and fused. The compile step also compiles the kernels of the GPU tests.

Setup, from the repository root (``COMMIT``: the version to compare with)::

    mkdir -p .scratch/cpab_old/cpab_old && touch .scratch/cpab_old/cpab_old/__init__.py
    cd .scratch/cpab_old/cpab_old
    for f in kernels ops expm; do git show COMMIT:kernels/regkit_kernels/cpab/$f.py > $f.py; done
    sed -i 's/from regkit_kernels.cpab.\(kernels\|expm\) import/from cpab_old.\1 import/' ops.py; cd -

then on the GPU machine (``carry`` ``.scratch/cpab_old`` and the wheels), with ``PYTHONPATH`` holding the repository,
``kernels``, ``apps`` and ``.scratch/cpab_old``: ``COMPILE_ONLY=1 python3 benchmarks/scripts/cpab_ab.py`` (every variant
compiled in parallel processes), then ``SKIP_COMPILE=1 python3 benchmarks/scripts/cpab_ab.py``. ``DRY=1`` with
``TRITON_INTERPRET=1``: tiny sizes on the CPU, no timings (checks that everything runs; minutes).
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
from regkit_kernels.cpab import cell_velocities, step_matrices, step_matrices_vjp

DRY = os.environ.get("DRY") == "1"
DEV = "cpu" if DRY else "cuda"
T = 50
GRID = (16, 20, 24) if DRY else (160, 192, 224)
# The new kernels' settings (ops module variables); DEFAULT as committed, the others change some of them.
DEFAULT = {"_BLOCK": 128, "_NUM_WARPS": 4, "_BWD_BLOCK": 32, "_BWD_WARPS": 1, "_MAXNREG": None, "_UNIFORM": True}
VARIANTS = {
    "default": {},
    "4 warps": {"_BWD_BLOCK": 128, "_BWD_WARPS": 4, "_UNIFORM": False},
    "capped": {"_MAXNREG": 96},
}


def use(name: str) -> None:
    for key, value in {**DEFAULT, **VARIANTS[name]}.items():
        setattr(new, key, value)


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


def guarded(fn):
    """``fn`` that prints its exception (one line) instead of raising: one failing variant stops no other."""

    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as error:
            print(f"{fn.__name__} {args[0] if args else ''} failed: {str(error).splitlines()[-1][:300]}", flush=True)
            return None

    return run


def _compile(spec) -> str:
    """Child process: compile one variant by running the integration and its backward on a few points: ``("old" or
    "new", variant, ndim, checkpoint_every, sorted)``, or ``("test", ndim, divide, steps, checkpoint_every, sorted)``
    for the kernels of the GPU tests (float32, point gradients too; the step matrices in float32 and float64)."""
    try:
        if spec[0] == "test":
            return _compile_test(spec)
        module, variant, ndim, every, sort = spec
        ops = old if module == "old" else new
        if module == "new":
            use(variant)
        ops._SORT_MIN = 0
        tess = Tessellation((2,) * ndim)
        basis = cpa_basis(tess, "zero")
        theta = (0.1 * torch.randn(2 if sort else 1, basis.d, device=DEV)).requires_grad_(True)
        pts = torch.rand(64, ndim, device=DEV).expand(theta.shape[0], -1, -1)
        for point_grad in (False, True):  # the timed kernels take theta's gradient alone, the checks both
            p = pts.detach().requires_grad_(point_grad)
            A = cell_velocities(basis, theta) if module == "new" else basis.to_A(theta)
            ops.cpab_integrate(p, A, tess, t=1.0, steps=T, checkpoint_every=every).sum().backward()
        sync()
    except Exception as error:
        return f"{spec} failed: {str(error).splitlines()[-1][:300]}"
    return str(spec)


def _compile_test(spec) -> str:
    from regkit.cpab.integrate import integrate

    _, ndim, divide, steps, every, sort = spec
    new._SORT_MIN = 0
    tess = Tessellation((2,) * ndim, (-1.0,) * ndim, (2.0,) * ndim) if divide else Tessellation((2,) * ndim)
    basis = cpa_basis(tess, "zero")
    theta = torch.randn(2, basis.d, device=DEV, requires_grad=True)
    pts = torch.rand(64, ndim, device=DEV)
    pts = (pts if sort else pts.expand(2, -1, -1).contiguous()).requires_grad_(True)
    out = integrate(pts, basis.to_A(theta), tess, t=1.0, steps=steps, backend="triton", checkpoint_every=every)
    out.sum().backward()
    A = 10.0 * torch.randn(3, ndim, ndim + 1, device=DEV)
    for dtype in (torch.float32, torch.float64):
        step_matrices_vjp(A.to(dtype), 0.1, step_matrices(A.to(dtype), 0.1))
        cell_velocities(basis, theta.detach().to(dtype).requires_grad_(True)).sum().backward()
    sync()
    return str(spec)


def specs():
    out = [("old", "default", 3, every, False) for every in (5, T)]
    out += [("new", variant, 3, every, False) for variant in VARIANTS for every in (5, T)]
    out += [("new", "default", ndim, every, True) for ndim in (2, 3) for every in (5, T)]
    tests = [(2, True, T, 5, False), (2, True, T, 5, True), (2, True, T, T, False), (3, True, T, 5, True)]
    tests += [(3, True, T, T, False), (3, True, T, 8, False), (2, False, 10, 4, False), (3, False, 10, 4, False)]
    return out + [("test", *t) for t in tests]


@guarded
def kernels(name, tess, A, pts, batch, variants) -> str:
    """Forward and backward kernel times, old and new variants; each new variant's end points against the old kernels'
    (bit-equal) and its gradients (relative difference: atomics' order, fused multiply-adds). Returns the variant
    with the fastest forward + backward kernels without checkpoints."""
    h = 1 / T
    P = pts.expand(batch, -1, -1)
    w = torch.randn(batch, *pts.shape, device=DEV)
    E = step_matrices(A, h)
    lean = {}
    for every in (5, T):
        order = old.point_order(P, tess)
        out, ck = old.cpab_fwd(P, E, tess, T, every, order)
        reference = (out, *old.cpab_bwd(P, ck, w, E, tess, T, every, True, True, order))
        kernel_row(f"{name} every {every} old", old, None, P, w, E, tess, every, None)
        for variant in variants:
            times = kernel_row(f"{name} every {every} new {variant}", new, variant, P, w, E, tess, every, reference)
            if every == T and times is not None:
                lean[variant] = sum(times)
    use("default")
    best = min(lean, key=lean.get) if lean else "default"
    print(f"{name}: fastest without checkpoints: {best}", flush=True)
    return best


@guarded
def kernel_row(label, ops, variant, P, w, E, tess, every, reference) -> tuple[float, float]:
    if variant is not None:
        use(variant)
    order = ops.point_order(P, tess)
    out, ck = ops.cpab_fwd(P, E, tess, T, every, order)
    check = ""
    if reference is not None:
        gp, gE = ops.cpab_bwd(P, ck, w, E, tess, T, every, True, True, order)
        rel = [((g - r).abs().max() / r.abs().max()).item() for g, r in zip((gp, gE), reference[1:], strict=True)]
        check = f" (end points equal {torch.equal(out, reference[0])}, grads rel {rel[0]:.1e} / {rel[1]:.1e})"
    fwd = ms(lambda: ops.cpab_fwd(P, E, tess, T, every, order))
    bwd = ms(lambda: ops.cpab_bwd(P, ck, w, E, tess, T, every, True, False, order))
    print(f"{label}: forward kernel {fwd:.3f} ms, backward kernel {bwd:.3f} ms{check}", flush=True)
    return fwd, bwd


@guarded
def whole(name, tess, basis, theta, pts, batch, variant="default", with_old=True) -> None:
    """integrate forward + backward (to_A, the loss and its backward included): graphed, eager and peak; old, new
    (``variant``) with PyTorch's to_A and with the fused one (``cell_velocities``)."""
    w = torch.randn(batch, *pts.shape, device=DEV)
    P = pts.expand(batch, -1, -1)
    rows = [("old", old, basis.to_A)] if with_old else []
    rows += [
        (f"new {variant}", new, basis.to_A),
        (f"new {variant} + fused to_A", new, lambda th: cell_velocities(basis, th)),
    ]
    use(variant)
    for every in (5, T):
        for label, ops, to_a in rows:

            def run(ops=ops, every=every, to_a=to_a) -> None:
                out = ops.cpab_integrate(P, to_a(theta), tess, t=1.0, steps=T, checkpoint_every=every)
                theta.grad = None
                (out * w).sum().backward()

            whole_row(f"{name} every {every} {label}", run)
    use("default")


@guarded
def whole_row(label, run) -> None:
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
    print(f"{label}: whole GPU (graph) {graph:.3f} ms, eager {eager:.3f} ms, peak {peak:.1f} MiB", flush=True)


@guarded
def small_pieces(name, basis, theta) -> None:
    h = 1 / T
    A = basis.to_A(theta).detach()
    G = torch.randn_like(A)
    th = theta.detach().requires_grad_(True)
    g = torch.randn(*A.shape, device=DEV)

    def to_a() -> None:
        (basis.to_A(th) * g).sum().backward()

    def fused_to_a() -> None:
        (cell_velocities(basis, th) * g).sum().backward()

    print(
        f"{name}: step matrices {graph_ms(lambda: step_matrices(A, h)):.3f} ms, adjoint "
        f"{graph_ms(lambda: step_matrices_vjp(A, h, G)):.3f} ms, to_A + backward {graph_ms(to_a):.3f} ms, "
        f"fused to_A + backward {graph_ms(fused_to_a):.3f} ms (graphs, the product with g and its sum included)",
        flush=True,
    )


if __name__ == "__main__":
    start = time.perf_counter()
    if os.environ.get("SKIP_COMPILE") == "1":
        pass
    elif DRY:
        for spec in specs():
            print(_compile(spec), flush=True)
    else:
        items = sorted(specs(), key=lambda spec: -(spec[1] if spec[0] == "test" else spec[2]))  # 3D (slowest) first
        with multiprocessing.get_context("spawn").Pool(16) as pool:
            done = pool.map(_compile, items)
        print("\n".join(d for d in done if "failed" in d))
        print(f"compiled {len(done)} variants: {time.perf_counter() - start:.1f} s", flush=True)
        if os.environ.get("COMPILE_ONLY") == "1":
            sys.exit(0)
    small = (4, 4, 4) if DRY else (16, 16, 16)
    tess, basis, theta, pts = case(small, 1, 0)
    A = basis.to_A(theta).detach()
    best = kernels(f"grid {small}", tess, A, pts, 1, list(VARIANTS)) or "default"
    whole(f"grid {small}", tess, basis, theta, pts, 1, best)
    small_pieces(f"grid {small}", basis, theta)
    n = 2000 if DRY else 125_000
    for shape, batch in (((2, 2, 2), 2),) if DRY else (((8, 8, 8), 8), ((32, 32), 16), ((16, 16, 16), 8)):
        tess, basis, theta, pts = case(shape, batch, n)
        whole(f"{shape} B{batch}", tess, basis, theta, pts, batch, best, with_old=False)
        small_pieces(f"{shape} B{batch}", basis, theta)
    print(f"done in {time.perf_counter() - start:.1f} s", flush=True)
