#!/usr/bin/env bash
# The chaos soak at scale (issue 45 item 2; tests/chaos_soak.py says what it checks): seeds
# 0..19 of a K = 4 run with float16 on the wire (even seeds wire.parts=2 under hardsync, odd
# seeds a Rudra-adv tree per range), a role SIGKILLed every 2-5 s; then the same seeds without
# kills (the fault-free spread); then the verdict per seed. CPU-heavy: about 2 min a chaos run
# and 1 a fault-free one on 2 loaded cores. WRAP runs each batch of SEEDS (5 seeds) under a
# lock of yours (e.g. WRAP=/work/tools/shared); OUT holds the runs and their JSON. LIMIT (s):
# how long a batch may run once it holds the lock (the time waiting for it does not count, as
# it would with a `timeout` around this script); a batch cut short ends its run in progress
# and kills what is left of it, and the seeds it finished keep their JSON. Unset: no limit
# but each run's own (tests/chaos_soak.py: about 12 min at most).
#
#   bash bench/chaos_soak.sh                               # all 20 seeds, then the summary
#   BATCHES="0-4" bash bench/chaos_soak.sh                 # one batch, summary of what is there
#   WRAP=/work/tools/shared LIMIT=900 BATCHES="12-14" bash bench/chaos_soak.sh
set -u
OUT=${OUT:-runs/chaos-soak}
WRAP=${WRAP:-}
LIMIT=${LIMIT:-}
BATCHES=${BATCHES:-0-4 5-9 10-14 15-19}
PY=${PY:-python}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LIMITED=${LIMIT:+timeout --kill-after=90 $LIMIT}  # inside WRAP: after the lock is taken
for seeds in $BATCHES; do
    for calm in "" --calm; do
        $WRAP $LIMITED $PY tests/chaos_soak.py run "$seeds" --out "$OUT" $calm 2>&1 |
            tee -a "$OUT/soak.log"
    done
done
$PY tests/chaos_soak.py summary "$OUT" | tee "$OUT/summary.txt"
