"""Compile the fused WTConv kernels of one layer configuration for an H100/H200 (sm_90) on a machine without a GPU,
with Triton's bundled toolchain, and print per kernel the compile seconds by stage, registers, stack and the SASS
instruction count of each loop body (the instructions between a backward branch and its target).

    PYTHONPATH=kernels python benchmarks/scripts/wtconv_compile.py --ndim 2 --k 5 --levels 5 [--dtype bf16]

A fresh Triton cache is used, so every kernel compiles. ``MLIR_ENABLE_TIMING=1`` in the environment adds Triton's
per-pass timings (how the coalescing pass's cost was found, see ``kernels2d.py``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="wtconv-compile-")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton
import triton.backends.nvidia.compiler as nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from regkit_kernels.launch import pow2
from regkit_kernels.wtconv import ops

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_STAGE_SECONDS: dict[str, float] = {}


def _timed_stages() -> None:
    """Wrap every compile stage of the CUDA backend so that its seconds go to ``_STAGE_SECONDS``."""
    add_stages = nvidia.CUDABackend.add_stages

    def wrapped(self, stages, options, language):
        add_stages(self, stages, options, language)
        for name, stage in list(stages.items()):

            def timed(src, metadata, stage=stage, name=name):
                start = time.perf_counter()
                result = stage(src, metadata)
                _STAGE_SECONDS[name] = _STAGE_SECONDS.get(name, 0.0) + time.perf_counter() - start
                return result

            stages[name] = timed

    nvidia.CUDABackend.add_stages = wrapped


def _sass_summary(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([f"{_BIN}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([f"{_BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    regs = re.findall(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    lines = [line for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", line)]
    addresses = [int(re.match(r"\s*/\*([0-9a-f]+)\*/", line).group(1), 16) for line in lines]  # type: ignore[union-attr]
    loops = []
    for line, at in zip(lines, addresses, strict=True):
        branch = re.search(r"BRA\s+0x([0-9a-f]+)", line)
        if branch and int(branch.group(1), 16) < at:
            loops.append(sum(1 for a in addresses if int(branch.group(1), 16) <= a <= at))
    return f"registers/stack {', '.join('/'.join(r) for r in regs)}, {len(lines)} instructions, loops {loops}"


def _compile(name: str, kernel: triton.JITFunction, constants: dict[str, int], dtype: str, warps: int) -> float:
    io = {"x_ptr", "dy_ptr", "out_ptr", "dx_ptr", "src_ptr"}  # the tensors in the layer's dtype
    signature = {}
    for arg in kernel.arg_names:
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = "*" + (dtype if arg in io else "fp32")
        else:
            signature[arg] = "i32"
    _STAGE_SECONDS.clear()
    start = time.perf_counter()
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps},
    )
    seconds = time.perf_counter() - start
    stages = ", ".join(f"{stage} {s:.1f}" for stage, s in _STAGE_SECONDS.items())
    print(f"{name:8s} {seconds:5.1f} s ({stages}); {_sass_summary(compiled.asm['cubin'])}", flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ndim", type=int, choices=(2, 3), default=2)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--levels", type=int, default=5)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    _timed_stages()
    kern, k, levels = ops.KERNELS[args.ndim], args.k, args.levels
    tile = {"NP": 1, "TY": 16, "TX": 64} if args.ndim == 2 else {"NP": 1, "TZ": 4, "TY": 4, "TX": 64}
    conv = {"LEVELS": levels, "K": k, "BLOCK": kern.block}
    wgrad = {"LEVELS": levels, "K": k, "KP": pow2(k), "BLOCK": kern.wgrad_block}
    jobs = [
        ("lowpass", kern.lowpasses, {"DEPTH": min(levels - 1, ops.LOWPASS_DEPTH), **tile}, kern.num_warps),
        ("levels", kern.levels, {**conv, "DIR": 1}, kern.num_warps),
        ("fwd", kern.fwd, {**conv, "HAS_BIAS": 1}, kern.num_warps),
    ]
    if kern.wgrad_levels:
        wgrad["LEVEL_BLOCK"] = kern.block
    else:
        jobs.append(("levels-1", kern.levels, {**conv, "DIR": -1}, kern.num_warps))
    jobs.append(("wgrad", kern.wgrad, wgrad, kern.wgrad_warps))
    jobs.append(("bwd", kern.bwd, {**conv, "HAS_BIAS": 1, "TAPS": pow2(k**args.ndim)}, kern.num_warps))
    total = sum(_compile(name, kernel, constants, args.dtype, warps) for name, kernel, constants, warps in jobs)
    print(f"total {total:.1f} s ({args.ndim}D, k = {k}, {levels} levels, {args.dtype})")


if __name__ == "__main__":
    main()
