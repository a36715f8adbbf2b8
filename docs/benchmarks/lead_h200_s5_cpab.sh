#!/bin/bash
# Session 5, lead's second device call: issue 5's GPU run (helper's script, trimmed timeouts) with the fused basis map
# wired into CPABasis.to_A, plus the engine's graphed-vs-eager GPU test.
S=$(date +%s); el() { echo "[$(( $(date +%s) - S )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wmin/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/kernels:$PWD/apps:$PWD/.scratch/cpab_old:$PWD/docs/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,driver_version --format=csv,noheader | tee $OUT/gpu.txt
el compile
COMPILE_ONLY=1 timeout 100 python3 docs/benchmarks/cpab_ab.py 2>&1 | tail -6 > $OUT/compile.txt
el tests
REGKIT_TEST_CUDA=1 timeout 110 python3 -m pytest tests/kernels/test_cpab_fused.py tests/core/cpab/test_basis.py -q -p no:cacheprovider \
    -k "realistic or step_matrices_equal or own_steps or cell_velocities or flush_skip or triton_face" 2>&1 | tail -6 > $OUT/tests.txt
cat $OUT/tests.txt | tail -2
el graphs
REGKIT_TEST_CUDA=1 timeout 70 python3 -m pytest -q -m gpu tests/core/test_engine_graphs.py -p no:cacheprovider 2>&1 | tail -3 > $OUT/graphs.txt
cat $OUT/graphs.txt
el ab
SKIP_COMPILE=1 timeout $(( 540 - ($(date +%s) - S) )) python3 docs/benchmarks/cpab_ab.py > $OUT/ab.txt 2>&1
tail -40 $OUT/ab.txt
el done
