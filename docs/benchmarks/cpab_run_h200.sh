#!/bin/bash
# Issue 5's GPU run on the H200 machine, from the repository root, with git-ignored wheels (typer, pydantic, ...) in
# $WHEELS (default .wmin) and the kernels to compare with in .scratch/cpab_old (cpab_ab.py's docstring says how to make
# them; carry both): every kernel variant of the A/B and of the GPU tests compiled in parallel, the GPU tests of the
# fused kernels, the A/B (kernel times, checks against the old kernels, whole passes graphed and eager with peak
# memory), then `regkit bench cpab` for the fused methods (--methods fused,fused_lean; the comparison with forward
# sensitivity runs too). About 4-6 minutes with a cold Triton cache.
# Writes compile.txt, tests.txt, ab.txt and bench.md under $OUT (default: ./cpab-h200-out).
set -o pipefail
OUT=${OUT:-cpab-h200-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${WHEELS:-.wmin}"/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels:$PWD/apps:$PWD/.scratch/cpab_old:$PWD/docs/benchmarks
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
COMPILE_ONLY=1 timeout 120 python3 docs/benchmarks/cpab_ab.py 2>&1 | tail -12 | tee "$OUT/compile.txt"
REGKIT_TEST_CUDA=1 timeout 120 python3 -m pytest tests/kernels/test_cpab_fused.py -q -p no:cacheprovider \
    -k "realistic or step_matrices_equal or own_steps or cell_velocities or flush_skip" 2>&1 | tail -15 \
    | tee "$OUT/tests.txt"
SKIP_COMPILE=1 timeout 150 python3 docs/benchmarks/cpab_ab.py 2>&1 | tee "$OUT/ab.txt"
timeout 240 python3 -m regkit_cli.main bench cpab --device cuda --methods fused,fused_lean --output "$OUT/bench.md" \
    2>&1 | tail -3 | tee "$OUT/bench_log.txt"
