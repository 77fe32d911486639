#!/usr/bin/env bash
# GPU learner checks, as one script for a machine with a CUDA GPU (the `device` tool's, or
# yours): installs rudra_zmq into the python3 that has a CUDA torch, runs the GPU tests
# (tests/test_gpu.py) and the training-throughput benchmark with GPU learners. Logs go to
# $OUT (default ./gpu_check_out). Needs pyzmq: from the index, or wheels in .devwheels/
# (a machine without network: `pip download pyzmq --only-binary=:all: -d .devwheels ...`).
#
#   bash bench/gpu_check.sh
set -u
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
{
    date -u; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    $PY -c "import zmq" 2>/dev/null || $PY -m pip install -q --no-index --no-deps .devwheels/pyzmq-*.whl
    $PY -m pip install -q --no-deps --no-build-isolation -e . && echo "installed rudra_zmq"
} 2>&1 | tee "$OUT/setup.log"
$PY -m pytest -q -s -rs -p no:cacheprovider tests/test_gpu.py tests/test_flat.py 2>&1 \
    | tee "$OUT/gpu_tests.log"
# a GPU step is ~4 ms: 60 epochs of 8192 samples give a steady-state window of several seconds
$PY -m rudra_zmq bench train-throughput --device cuda --cases lambda1 default --no-one-thread-ref \
    --epochs 60 --skip-s 3 --baseline-s 10 2>&1 | tee "$OUT/train_throughput_gpu.log"
