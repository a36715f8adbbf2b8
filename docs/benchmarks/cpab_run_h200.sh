#!/bin/bash
# Issue 5's GPU run on the H200 machine, from the repository root, with git-ignored wheels (typer and pydantic) in
# $WHEELS (default .whl): the CPAB pieces (which also compile every kernel variant in parallel first), the GPU tests of
# the fused kernels, then `regkit bench cpab` for all methods but forward sensitivity (which the gradient comparison
# still runs: the full tables of it take minutes).
# Writes pieces.txt, tests.txt and bench.md under $OUT (default: ./cpab-h200-out).
set -o pipefail
OUT=${OUT:-cpab-h200-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site "${WHEELS:-.whl}"/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels:$PWD/apps PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 docs/benchmarks/cpab_pieces.py 2>&1 | tee "$OUT/pieces.txt"
REGKIT_TEST_CUDA=1 python3 -m pytest tests/kernels/test_cpab_fused.py -q -x -p no:cacheprovider \
    -k "realistic or step_matrices_equal" 2>&1 | tail -25 | tee "$OUT/tests.txt"
python3 -m regkit_cli.main bench cpab --device cuda --methods fused,fused_lean,factorized,unrolled --output "$OUT/bench.md" 2>&1 \
    | tail -3 | tee "$OUT/bench_log.txt"
