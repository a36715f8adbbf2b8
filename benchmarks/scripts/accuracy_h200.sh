#!/usr/bin/env bash
# `python -m benchmarks accuracy` on one H200 (device kind `nvidia-h200`): regkit (lncc, mi) and FireANTs on the GPU, on
# 1 mm and 2 mm MNI152 pairs. ANTs, elastix and SimpleITK are CPU tools: their numbers come from the CPU run
# (benchmarks/results/accuracy-cpu.md) and they show as "not installed" here.
#
# 1. Here, once, in the repository root (needs the dev venv's nilearn), a few seconds:
#        bash benchmarks/scripts/accuracy_h200.sh prepare
#    copies nilearn's three bundled MNI152 1 mm files (T1, GM, WM: 5.1 MB) into .bench_data/ (git-ignored through
#    .git/info/exclude) and downloads the FireANTs wheel (fireants-1.5.0-py3-none-any.whl, 0.2 MB) into .whl/.
#    FireANTs' other needs are on the device already (torch, scikit-image, pandas, matplotlib, tqdm) or carried for
#    regkit anyway (nibabel, SimpleITK): its pin simpleitk==2.2.1 is skipped (--no-deps) and it runs on regkit's
#    SimpleITK 2.5.3 wheel (checked on the CPU with 2.5.7: same field on the sanity pair). Carry budget: .whl 58.3 MB
#    (SimpleITK alone 52.6 MB) + .bench_data 5.1 MB + the work tree (~2.5 MB) = ~66 MB of the 64 MiB (67.1 MB) limit;
#    if the tree has grown, carry .bench_data with the T1 file alone (1.6 MB; then give PAIRS=1mm,2mm).
#    The fused CUDA ops of FireANTs (fireants_fused_ops) are not on PyPI: FireANTs runs its PyTorch path here.
# 2. On the device (`run`, carry [".whl", ".bench_data"], timeout_s 600), ~5 minutes:
#        bash benchmarks/scripts/accuracy_h200.sh run
#    or, for other pair sets (comma-separated, see docs/accuracy.md):
#        PAIRS=1mm,2mm bash benchmarks/scripts/accuracy_h200.sh run
#    writes to $OUT: accuracy-h200.md (the command and the tables), accuracy-h200.csv, accuracy-h200.png, bench.txt
#    (the console output). "reg s" is the registration call after one untimed warm-up (compilation, allocator);
#    "wall s" is the whole tool process (Python start, imports, Triton compilation, warm-up, I/O): the 1 mm target
#    (under 1 s end to end) is read from "reg s", with "wall s" beside it.
set -euo pipefail
mode=${1:?usage: accuracy_h200.sh prepare|run}
PYTHON=${PYTHON:-python3}
PAIRS=${PAIRS:-1mm,contrast1mm,2mm}

case "$mode" in
prepare)
    PYTHON=${PYTHON_HERE:-/work/venv/bin/python}
    grep -qx '/.bench_data/' .git/info/exclude || echo '/.bench_data/' >>.git/info/exclude
    mkdir -p .bench_data .whl
    data=$("$PYTHON" -c "import importlib.util, pathlib; \
print(pathlib.Path(importlib.util.find_spec('nilearn').submodule_search_locations[0]) / 'datasets' / 'data')")
    for kind in t1 gm wm; do cp "$data/mni_icbm152_${kind}_tal_nlin_sym_09a_converted.nii.gz" .bench_data/; done
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d .whl fireants==1.5.0
    du -sh .whl .bench_data
    ;;
run)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD:$PWD/kernels:$PWD/apps" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader || true
    "$PYTHON" -m benchmarks accuracy --pairs "$PAIRS" --deformations 1 \
        --tools regkit-lncc,regkit-mi,fireants --device cuda --threads 8 --fireants-python "$PYTHON" \
        --mni-data .bench_data --timeout 240 --out /tmp/accuracy 2>&1 | tee "$OUT/bench.txt"
    for ext in md csv png; do cp "/tmp/accuracy/accuracy.$ext" "$OUT/accuracy-h200.$ext" 2>/dev/null || true; done
    ;;
*)
    echo "usage: accuracy_h200.sh prepare|run" >&2
    exit 2
    ;;
esac
