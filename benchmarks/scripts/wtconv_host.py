"""Host (CPU-side) time of the fused WTConv layer's eager step on a CUDA GPU (the host-time section of
``benchmarks/results/wtconv-h200.md``).

    PYTHONPATH=.:kernels:apps python benchmarks/scripts/wtconv_host.py [--parts PART,PART,...]   # default: all parts

* ``breakdown``: where a step's host time goes (stage 4 and stage 1, fp32): timestamps around ``zero_grad``, the
  layer's call, the autograd Function's forward and backward bodies, ``wtconv_bwd`` and ``.backward()``, over 200
  steps run back to back without syncs (the host never waits for the GPU), medians in microseconds.
* ``autograd``: PyTorch's own cost per step of an autograd Function that launches nothing but takes 0, 1, 3, 7 or 13
  parameters (the layer has 2 L + 3).
* ``launch``: the host cost of one Triton launch, through the JIT and through the compiled kernel's own ``run``.
* ``blocks``: blocks of 100 synced eager steps, fp32 and bf16 alternating, at stages 4, 3 and 1: how much an eager step
  moves from block to block when it is host time.
* ``interleaved``: the bench's interleaved comparison (``benchmarks.wtconv.interleaved``) of every 2D stage.

To see the GPU's clock meanwhile: ``nvidia-smi --query-gpu=timestamp,clocks.sm --format=csv -lms 200`` beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from regkit.features import WTConv
from regkit_kernels.wtconv import ops

_STAGE4 = ((64, 768, 7, 7), 2)
_STAGE3 = ((64, 384, 14, 14), 3)
_STAGE1 = ((64, 96, 56, 56), 5)


def _layer_step(shape: tuple[int, ...], levels: int, dtype: torch.dtype) -> Callable[[], None]:
    torch.manual_seed(0)
    layer = WTConv[2](shape[1], 5, levels, backend="triton").cuda()
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(shape, device="cuda", dtype=dtype)

    def step() -> None:
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).backward(g)

    return step


def breakdown() -> None:
    marks: dict[str, list[float]] = {}
    stamps: dict[str, float] = {}
    function, wtconv_bwd = ops.WTConvFunction, ops.wtconv_bwd
    forward, backward = function.forward, function.backward

    def add(name: str, seconds: float) -> None:
        marks.setdefault(name, []).append(seconds)

    def timed_forward(ctx, *args):
        start = time.perf_counter()
        out = forward(ctx, *args)
        stamps["forward end"] = time.perf_counter()
        add("the Function's forward body", stamps["forward end"] - start)
        return out

    def timed_backward(ctx, grad):
        stamps["backward start"] = time.perf_counter()
        add("engine: forward's end -> backward's start", stamps["backward start"] - stamps["forward end"])
        grads = backward(ctx, grad)
        stamps["backward end"] = time.perf_counter()
        add("the Function's backward body", stamps["backward end"] - stamps["backward start"])
        return grads

    def timed_wtconv_bwd(*args):
        start = time.perf_counter()
        result = wtconv_bwd(*args)
        add("of which wtconv_bwd", time.perf_counter() - start)
        return result

    function.forward, function.backward = staticmethod(timed_forward), staticmethod(timed_backward)  # type: ignore[method-assign,assignment]
    ops.wtconv_bwd = timed_wtconv_bwd
    try:
        for shape, levels in (_STAGE4, _STAGE1):
            torch.manual_seed(0)
            layer = WTConv[2](shape[1], 5, levels, backend="triton").cuda()
            x = torch.randn(shape, device="cuda", requires_grad=True)
            g = torch.randn(shape, device="cuda")
            marks.clear()
            for i in range(220):
                t0 = time.perf_counter()
                x.grad = None
                layer.zero_grad(set_to_none=True)
                t1 = time.perf_counter()
                out = layer(x)
                t2 = time.perf_counter()
                out.backward(g)
                t3 = time.perf_counter()
                if i < 20:  # warm-up
                    continue
                add("zero_grad", t1 - t0)
                add("layer(x)", t2 - t1)
                add("out.backward(g)", t3 - t2)
                add("engine: backward's end -> .backward() returns", t3 - stamps["backward end"])
                add("step", t3 - t0)
            torch.cuda.synchronize()
            print(f"breakdown {shape} L{levels}, fp32, steps back to back (us, medians of 200):")
            for name, values in marks.items():
                print(f"  {name:48s} {statistics.median(values[-200:]) * 1e6:8.1f}")
    finally:
        function.forward, function.backward, ops.wtconv_bwd = forward, backward, wtconv_bwd  # type: ignore[method-assign]


def _nothing_step(x: torch.Tensor, g: torch.Tensor, count: int) -> Callable[[], None]:
    """A step through an autograd Function that launches nothing but takes ``count`` parameters."""
    params = [torch.nn.Parameter(torch.randn(384, 1, 5, 5, device="cuda")) for _ in range(count)]
    flat = torch.zeros(sum(p.numel() for p in params) + 1, device="cuda")

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *params):
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, grad):
            views = flat.split([p.numel() for p in params] + [1])
            return (torch.empty_like(grad), *(v.view(p.shape) for v, p in zip(views, params, strict=False)))

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        Nothing.apply(x, *params).backward(g)

    return step


def autograd() -> None:
    x = torch.randn(64, 96, 8, 8, device="cuda", requires_grad=True)
    g = torch.randn_like(x)
    for count in (0, 1, 3, 7, 13):
        step = _nothing_step(x, g, count)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        best = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(300):
                step()
            best.append((time.perf_counter() - start) / 300 * 1e6)
            torch.cuda.synchronize()
        print(f"autograd: a launch-free Function with {count:2d} parameters: {min(best):6.1f} us per step")


def blocks() -> None:
    for shape, levels in (_STAGE4, _STAGE3, _STAGE1):
        steps = {
            name: _layer_step(shape, levels, dtype)
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        }
        for step in steps.values():
            step()
            step()
        cells = []
        for name in ("fp32", "bf16", "fp32", "bf16", "bf16", "fp32"):
            times = []
            for _ in range(100):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                steps[name]()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            cells.append(f"{name} {statistics.median(times):.3f}")
        print(f"blocks {shape} L{levels}: medians of 100 synced steps (ms): {', '.join(cells)}", flush=True)


def interleaved() -> None:
    from benchmarks import wtconv as bench

    for case in (c for c in bench.FULL_CASES if c.ndim == 2):
        print(bench.interleaved_line(case, bench.interleaved(case, "cuda", 3.0, 600)), flush=True)


def launch() -> None:
    """Host cost of one launch of the levels kernel (stage 4): through Triton's JIT (``kernel[grid](...)``, which
    binds and specialises the arguments on every call) and through the compiled kernel's own ``run`` (what the JIT
    calls last; Triton 3.6's signature), which this layer does not use."""
    shape, levels = _STAGE4
    x = torch.randn(shape, device="cuda")
    kern, plan = ops.KERNELS[2], ops.launch_plan(shape, levels, 5, x.device)
    low, coarse = x.new_empty(plan.low_numel), x.new_empty(plan.coarse_numel)
    params = torch.randn(levels * shape[1] * 4 * 26, device="cuda")
    args = (low, params, coarse, shape[0], shape[1], *shape[2:])
    constants = {"LEVELS": levels, "K": 5, "DIR": 1, "BLOCK": plan.level_block}
    compiled = kern.levels[(plan.level_programs,)](*args, **constants, num_warps=kern.num_warps)
    stream = torch.cuda.current_stream().cuda_stream
    full = (*args, *constants.values())

    def jit() -> None:
        kern.levels[(plan.level_programs,)](*args, **constants, num_warps=kern.num_warps)

    def direct() -> None:
        compiled.run(
            plan.level_programs, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *full
        )

    for name, fn in (("JIT", jit), ("compiled kernel's run", direct)):
        fn()
        torch.cuda.synchronize()
        best = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(2000):
                fn()
            best.append((time.perf_counter() - start) / 2000 * 1e6)
            torch.cuda.synchronize()
        print(f"launch of the levels kernel through the {name}: {min(best):.1f} us of host")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="breakdown,autograd,launch,blocks,interleaved")
    parts = {
        "breakdown": breakdown,
        "autograd": autograd,
        "launch": launch,
        "blocks": blocks,
        "interleaved": interleaved,
    }
    for name in parser.parse_args().parts.split(","):
        parts[name]()


if __name__ == "__main__":
    main()
