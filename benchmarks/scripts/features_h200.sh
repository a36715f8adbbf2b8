#!/usr/bin/env bash
# Trains the feature network's shipped weights (regkit/data/features-2d.pt, features-3d.pt, from the recipes
# regkit/features/training/features-2d.yaml, features-3d.yaml) on H200 GPUs: a one-off, apart from the benchmarks
# (benchmarks/scripts/h200.sh runs `python -m benchmarks features` with the weights in regkit/data).
#
# 1. Here, in the repository root: `bash benchmarks/scripts/h200.sh prepare` (the wheels and
#    .h200/data/brain_labels.nii.gz, the label map the training synthesises from).
# 2. On the device (`run`, carry [".h200/wheels", ".h200/data"], timeout_s 600):
#        bash benchmarks/scripts/features_h200.sh
#    trains the 2D network for the first 424 steps of its schedule (the shipped 2D weights) and the 3D network for its
#    whole 2,800-step schedule (about 7 minutes on one H200), fused WTConv kernels, bfloat16 autocast; with two GPUs
#    (kind nvidia-h200-x2) both at once, one process per GPU, else one after the other (then give the 3D run a call
#    of its own: DIMS=3). Writes to $OUT: features-2d.pt, features-3d.pt (the weights; their `meta` records the steps
#    done), log-2d.csv, log-3d.csv (loss and samples/s per step), train-2d.txt, train-3d.txt (the commands' output,
#    ending with "N/M steps").
# 3. Here: copy the .pt files into regkit/data/, then rerun the features benchmark (h200.sh, and on the CPU
#    `python -m benchmarks features --part 2d`) and keep the weights only if `features` does at least as well as with
#    the weights they replace. The recipes' InfoNCE stays near its chance level (log 33 = 3.50 in 2D, log 105 = 4.65 in
#    3D) even for good features: the benchmark, not the loss, judges them.
set -euo pipefail
PYTHON=${PYTHON:-python3}
DIMS=${DIMS:-2 3}
OUT=${OUT:-/tmp/features-weights}
mkdir -p "$OUT"
shopt -s nullglob
wheels=(.h200/wheels/*.whl)
[ ${#wheels[@]} -eq 0 ] ||
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}"
export PYTHONPATH="/tmp/site:$PWD:$PWD/kernels:$PWD/apps" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader || true
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")

train() { # dim, GPU
    local stop=()
    [ "$1" = 2 ] && stop=(--stop-after 424)
    CUDA_VISIBLE_DEVICES=$2 "$PYTHON" -m regkit_cli train-features "features-$1d" -o "/tmp/features-$1d" \
        --device cuda --labels .h200/data/brain_labels.nii.gz "${stop[@]}" >"$OUT/train-$1d.txt" 2>&1
}

status=0
gpu=0
for dim in $DIMS; do
    if [ "$gpus" -gt 1 ]; then
        train "$dim" $((gpu++ % gpus)) &
    else
        train "$dim" 0 || status=1
    fi
done
for job in $(jobs -p); do wait "$job" || status=1; done
for dim in $DIMS; do
    tail -n 3 "$OUT/train-${dim}d.txt"
    cp "/tmp/features-${dim}d/features-${dim}d.pt" "$OUT/" || status=1
    cp "/tmp/features-${dim}d/log.csv" "$OUT/log-${dim}d.csv" || status=1
done
exit $status
