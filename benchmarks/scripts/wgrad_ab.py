r"""The fused WTConv backward of the working tree against a frozen copy of the previous kernels (``wtconv_old``).

For the four WTConvNeXt stage shapes (batch 64, k 5, levels 5 / 4 / 3 / 2, float32 and bfloat16) and the 3D shape
(2, 32, 96, 112, 96) L3 k5 (float32): the weight-gradient launch's GPU time (torch.profiler, mean of 5 backward passes;
in 2D that launch also runs the levels' backward), the whole layer's forward + backward replayed from a CUDA graph
(median of 20 replays), old and new, and the largest relative difference between the new gradients (input and every
parameter) and the old ones (max |new - old| / max |old|, over all gradients). With ``--variants``, the new kernel's
tilings (``VARIANTS``: the ``_Kernels`` fields of ``regkit_kernels.wtconv.ops``) are timed at float32 at stages 1
and 2 (2D variants) or the 3D shape (3D variants) and checked the same way. Every configuration is compiled first, in
parallel processes (10-25 s each on their own), so that a run stays within 150 s.

Setup (the old kernels: session 5's, commit c2ddbed, or any other commit's), once::

    mkdir -p .scratch/wtconv_old && for f in __init__ _tile kernels2d kernels3d ops; do
        git show c2ddbed:kernels/regkit_kernels/wtconv/$f.py > .scratch/wtconv_old/$f.py; done
    sed -i 's/regkit_kernels\.wtconv\b/wtconv_old/g' .scratch/wtconv_old/*.py

Run from the repository root on the GPU machine (carry ``.scratch/wtconv_old``); the table goes to stdout and, when
``$OUT`` is set, to ``$OUT/wgrad_ab.md``::

    PYTHONPATH=$PWD:$PWD/kernels:$PWD/apps:$PWD/.scratch python3 benchmarks/scripts/wgrad_ab.py --variants all

``--tiny``: small shapes on the CPU through ``TRITON_INTERPRET=1`` (no timings; checks that everything runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import statistics
import sys
import time

import torch
import wtconv_old.ops as old

import regkit_kernels.wtconv.ops as new
from benchmarks.common import capture_graph

# (name, x shape, levels, dtypes); k = 5 everywhere.
CASES = [
    ("stage 1", (64, 96, 56, 56), 5, ("float32", "bfloat16")),
    ("stage 2", (64, 192, 28, 28), 4, ("float32", "bfloat16")),
    ("stage 3", (64, 384, 14, 14), 3, ("float32", "bfloat16")),
    ("stage 4", (64, 768, 7, 7), 2, ("float32", "bfloat16")),
    ("3D", (2, 32, 96, 112, 96), 3, ("float32",)),
]
TINY_CASES = [
    ("2D tiny", (2, 3, 13, 10), 3, ("float32", "bfloat16")),
    ("3D tiny", (1, 2, 6, 7, 5), 2, ("float32",)),
]
K = 5
# Tilings of the new weight-gradient kernel: changes to ``new._KERNELS[ndim]`` (a dataclass), by ndim. "default" is the
# package as it is.
VARIANTS: dict[str, dict[int, dict[str, int]]] = {
    "default": {},
    "2D block 256, 8 warps": {2: {"wgrad_block": 256, "wgrad_warps": 8}},
    "2D block 256, 4 warps": {2: {"wgrad_block": 256}},  # two pairs per thread, 168 registers
    "2D maxnreg 80": {2: {"wgrad_maxnreg": 80}},  # 6 programs per SM instead of 5, a few spills
    "2D 16 programs/SM": {2: {"wgrad_programs": 16}},
    "2D 64 programs/SM": {2: {"wgrad_programs": 64}},
    "3D maxnreg 128": {3: {"wgrad_maxnreg": 128}},  # 4 programs per SM instead of 3
    "3D block 64, 2 warps": {3: {"wgrad_block": 64, "wgrad_warps": 2}},
}
VARIANT_CASES = ("stage 1", "stage 2", "3D", "2D tiny", "3D tiny")  # where variants run
DEFAULT_KERNELS = dict(new._KERNELS)


def use(variant: str) -> None:
    """Select one of ``VARIANTS`` in the new package (launch plans are cached per shape, so they are cleared)."""
    for ndim, kern in DEFAULT_KERNELS.items():
        new._KERNELS[ndim] = dataclasses.replace(kern, **VARIANTS[variant].get(ndim, {}))
    new._plan.cache_clear()


def inputs(shape: tuple[int, ...], levels: int, dtype: torch.dtype, device: str) -> tuple[list[torch.Tensor], ...]:
    """x, the output gradient and the layer's parameters (base weight, bias, scale, level weights, level scales), with
    values away from their initial ones so that every term counts."""
    gen = torch.Generator(device="cpu").manual_seed(sum(shape) + levels)
    ndim, channels = len(shape) - 2, shape[1]

    def rand(*size: int) -> torch.Tensor:
        return (torch.rand(size, generator=gen) * 2 - 1).to(device)

    x = torch.randn(shape, generator=gen).to(device, dtype)
    grad = torch.randn(shape, generator=gen).to(device, dtype)
    params = [rand(channels, 1, *[K] * ndim), rand(channels), rand(channels)]
    params += [rand(channels * 2**ndim, 1, *[K] * ndim) for _ in range(levels)]
    params += [rand(channels * 2**ndim) for _ in range(levels)]
    return [x], [grad], params


def grads(ops, x: torch.Tensor, grad: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of x and of every parameter through ``ops.WTConvFunction``."""
    leaves = [x.detach().requires_grad_(True), *(p.detach().requires_grad_(True) for p in params)]
    out = ops.WTConvFunction.apply(*leaves)
    return list(torch.autograd.grad(out, leaves, grad))


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(
        ((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30)).item()
        for g, w in zip(got, want, strict=True)
    )


def wgrad_ms(ops, x: torch.Tensor, grad: torch.Tensor, params: list[torch.Tensor], levels: int) -> float:
    """Mean GPU time of the weight-gradient launch over 5 backward passes (torch.profiler)."""
    base_weight, bias, scale = params[:3]
    level_params = ops.level_params(params[3 : 3 + levels], params[3 + levels :])
    _, low = ops.wtconv_fwd(x, base_weight, bias, scale, level_params, levels)
    ops.wtconv_bwd(grad, x, low, base_weight, bias, scale, level_params, levels)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            ops.wtconv_bwd(grad, x, low, base_weight, bias, scale, level_params, levels)
        torch.cuda.synchronize()
    total_us = [e.self_device_time_total for e in prof.key_averages() if "wgrad_kernel" in e.key]
    return sum(total_us) / 5e3 if total_us else float("nan")  # one launch per backward pass


def graphed_ms(ops, x: torch.Tensor, grad: torch.Tensor, params: list[torch.Tensor]) -> float:
    """Median GPU time of one forward + backward replayed from a CUDA graph (20 replays, CUDA events)."""
    leaves = [x.detach().requires_grad_(True), *(p.detach().requires_grad_(True) for p in params)]

    def step() -> None:
        out = ops.WTConvFunction.apply(*leaves)
        torch.autograd.grad(out, leaves, grad)

    graph = capture_graph(step)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def jobs(cases: list, variants: list[str]) -> list[tuple[str, str, str]]:
    """(case name, dtype, implementation) to run: old and new at every case and dtype, the variants at float32 (at
    ``VARIANT_CASES`` of the variant's ndim)."""
    out = []
    for name, shape, _, dtypes in cases:
        for dtype in dtypes:
            out += [(name, dtype, "old"), (name, dtype, "new")]
            if dtype == "float32" and name in VARIANT_CASES:
                out += [(name, dtype, v) for v in variants if v != "default" and len(shape) - 2 in VARIANTS[v]]
    return out


def run(job: tuple[str, str, str], cases: list, timed: bool) -> dict:
    name, dtype_name, impl = job
    _, shape, levels, _ = next(c for c in cases if c[0] == name)
    device = "cuda" if timed or torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, dtype_name)
    (x,), (grad,), params = inputs(shape, levels, dtype, device)
    if impl != "old":
        use("default" if impl == "new" else impl)
    ops = old if impl == "old" else new
    result = {"grads": grads(ops, x, grad, params)}
    if timed:
        result["wgrad"] = wgrad_ms(ops, x, grad, params, levels)
        result["graphed"] = graphed_ms(ops, x, grad, params)
    else:
        result["wgrad"] = result["graphed"] = float("nan")
    return result


def _compile(args: tuple[tuple[str, str, str], list]) -> str:
    """One job's forward + backward in a process of its own: compiles its kernels into Triton's cache. Returns what
    went wrong, if anything (the job is then reported as failed, the others run)."""
    try:
        run(args[0], args[1], timed=False)
        torch.cuda.synchronize()
        return ""
    except Exception as error:
        return f"{args[0]}: {type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="default", help="comma-separated names of VARIANTS, or 'all'")
    parser.add_argument("--tiny", action="store_true", help="small shapes under TRITON_INTERPRET=1, no timings")
    parser.add_argument("--no-3d", action="store_true", help="leave the 3D case out")
    opts = parser.parse_args()
    variants = list(VARIANTS) if opts.variants == "all" else opts.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    cases = TINY_CASES if opts.tiny else CASES
    if opts.no_3d:
        cases = [c for c in cases if len(c[1]) == 4]
    timed = not opts.tiny
    if timed and not torch.cuda.is_available():
        sys.exit("needs CUDA (or --tiny with TRITON_INTERPRET=1)")
    todo = jobs(cases, variants)
    start = time.perf_counter()
    if timed:  # compile every configuration in parallel, one process each
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(min(len(todo), max(1, (os.cpu_count() or 2) - 1))) as pool:
            for error in pool.map(_compile, [(job, cases) for job in todo]):
                if error:
                    print("compile failed:", error, flush=True)
        print(f"compiled {len(todo)} configurations in {time.perf_counter() - start:.1f} s", flush=True)
    results = {}
    failed = {"grads": None, "wgrad": float("nan"), "graphed": float("nan")}
    for job in todo:
        try:
            results[job] = run(job, cases, timed)
        except Exception as error:  # reported, and the other jobs still run
            print(f"{job} failed: {type(error).__name__}: {str(error).strip()[:300]}", flush=True)
            results[job] = failed
        r = results[job]
        print(f"{job}: wgrad {r['wgrad']:.4g} ms, graphed {r['graphed']:.4g} ms", flush=True)
    lines = [
        "| case | dtype | version | wgrad launch ms | graphed fwd+bwd ms | wgrad old / this | graphed old / this "
        "| max rel. diff. to old |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, dtype, impl in todo:
        r, ref = results[(name, dtype, impl)], results[(name, dtype, "old")]
        if impl == "old":
            err = ""
        elif r["grads"] is None or ref["grads"] is None:
            err = "failed"
        else:
            err = f"{rel_err(r['grads'], ref['grads']):.2e}"
        lines.append(
            f"| {name} | {dtype} | {impl} | {r['wgrad']:.4g} | {r['graphed']:.4g} | "
            f"{ref['wgrad'] / r['wgrad']:.2f} | {ref['graphed'] / r['graphed']:.2f} | {err} |"
        )
    device = torch.cuda.get_device_name(0) if timed else "CPU (TRITON_INTERPRET=1)"
    table = "\n".join(lines) + f"\n\n{device}, torch {torch.__version__}; {time.perf_counter() - start:.0f} s\n"
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wgrad_ab.md"), "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
