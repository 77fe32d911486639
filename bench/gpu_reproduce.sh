#!/usr/bin/env bash
# Issue 26, item 4: Table 2's central rows at the paper's full 140 epochs through the simulator
# on one CUDA GPU: the µ = 128, λ = 1 baseline and σ = 1 and σ = 30 at µ = 4, λ = 30 (the paper:
# 18 %, 18.09 %, 18.41 %). The three points run side by side on the one GPU (the model is small),
# each for at most LIMIT_S seconds (the image cache is decoded once between them). Every
# evaluated epoch is a line of the point's log, so a point cut short still shows its curve
# there (the simulator writes its run directory only when it ends, and `report` reads only
# finished points); quote such a point at the epoch it reached, never as a 140-epoch figure.
#
#   bash bench/gpu_reproduce.sh                          # the `device` tool's machine, or yours
#   LIMIT_S=0 POINTS="baseline s1-mu4-l30" bash bench/gpu_reproduce.sh   # no time limit
#
# Data: DATA (default ../shared/data/cifar10-jpeg.tar.gz, else .data/cifar10-jpeg.tar.gz, which
# the device tool can carry). Results go to OUT (default ./gpu_reproduce_out): one log per point,
# setup.log (with `report`'s output) and results.tar.gz (the run directories, report.md, report.csv
# and the figures).
set -u
OUT=${OUT:-gpu_reproduce_out}
PY=${PY:-python3}
LIMIT_S=${LIMIT_S:-480}
DEVICE=${DEVICE:-cuda}   # cpu: a dry run of this script on a machine without a GPU
POINTS=${POINTS:-"baseline s1-mu4-l30 s30-mu4-l30"}
DATA=${DATA:-../shared/data/cifar10-jpeg.tar.gz}
[ -f "$DATA" ] || DATA=.data/cifar10-jpeg.tar.gz
WORK=${WORK:-/tmp/gpu_reproduce_runs}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
{
    date -u; nproc; nvidia-smi --query-gpu=name,memory.total --format=csv
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    $PY -c "import rudra_zmq" 2>/dev/null || $PY -m pip install -q --no-deps --no-build-isolation -e .
    ls -la "$DATA"
} 2>&1 | tee "$OUT/setup.log"
pids=()
for p in $POINTS; do
    lim=(); [ "$LIMIT_S" != 0 ] && lim=(timeout --signal=INT "$LIMIT_S")
    "${lim[@]}" $PY -m rudra_zmq sweep configs/grids/table2.yaml --simulate --only "$p" \
        --parent "$WORK/$p" --set data.root="$DATA" --set runtime.device="$DEVICE" \
        > "$WORK/$p.sweep.log" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
dirs=()
for p in $POINTS; do   # the point's own log: one line per evaluated epoch
    cat "$WORK/$p.sweep.log" "$WORK/$p/$p/sweep.log" > "$OUT/$p.log" 2>/dev/null
    tail -2 "$OUT/$p.log"
    dirs+=("$WORK/$p")
done
$PY -m rudra_zmq report "${dirs[@]}" --out "$WORK/report" 2>&1 | tee -a "$OUT/setup.log"
# at most 8 files come back from the device tool: the rest travels as one archive
tar -czf "$OUT/results.tar.gz" -C "$WORK" . 2>/dev/null
ls -la "$OUT"
