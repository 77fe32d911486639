#!/usr/bin/env bash
# Issue 24's LAN figures on a many-core machine (the `device` tool's 16 cores; root needed for
# the network namespaces), so that CPU is not what binds: K = 8 servers beside the learners and
# on 8 extra hosts, float32 and float16, the gloo allreduce beside them, and the in-stream
# overlap probe; then the GPU tests. PARTS="1 16" also runs hardsync in parts (wire.parts; the
# lan-table1 step then takes about twice as long: give it TABLE_S=600). Needs pyzmq (wheels in .whl/ on a machine without network).
# Without iproute2 there, .whl/iproute/bin/{ip,tc} are used (Debian's iproute2 and its libraries,
# unpacked with dpkg -x, run through the system's loader). Logs, CSV, PNG go to $OUT.
#
#   bash bench/lan24_device.sh
set -u
OUT=${OUT:-lan24_device_out}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
{
    command -v ip >/dev/null || export PATH=$PWD/.whl/iproute/bin:$PATH
    date -u; nproc; uname -r; ip -V; tc -V
    $PY -c "import zmq" 2>/dev/null || $PY -m pip install -q --no-index --no-deps .whl/pyzmq-*.whl
    $PY -m pip install -q --no-deps --no-build-isolation -e . && echo "installed rudra_zmq"
} > "$OUT/setup.log" 2>&1
tail -3 "$OUT/setup.log"
command -v ip >/dev/null || export PATH=$PWD/.whl/iproute/bin:$PATH
# the kernel must have namespaces, veth, a bridge and tbf: seconds to learn, else stop here
ip netns add rzchk && ip -n rzchk link add rzva type veth peer name rzvb && ip -n rzchk link add br0 \
    type bridge && tc -n rzchk qdisc add dev rzva root tbf rate 1gbit burst 512kb latency 20ms
ok=$?; ip netns del rzchk 2>/dev/null; [ $ok = 0 ] || { echo "no emulated LAN here"; exit 1; }
vmstat 5 > "$OUT/vmstat.log" 2>&1 &
VM=$!
timeout "${TABLE_S:-300}" $PY -m rudra_zmq bench lan-table1 --hosts 8 --per-host 1 \
    --params 10000000 --compute-ms 100 --epoch-gradients 64 --cases base-hardsync \
    gloo-allreduce --servers 8 --server-placement extra colocated --parts ${PARTS:-1} \
    --wire-dtypes float32 float16 \
    --csv "$OUT/lan24.csv" --png "$OUT/lan24.png" > "$OUT/lan24.log" 2>&1
echo "lan-table1 rc $?"; tail -25 "$OUT/lan24.log"
timeout 120 $PY -m rudra_zmq bench lan-overlap --servers 8 --parts 1 4 16 > "$OUT/overlap.log" 2>&1
echo "lan-overlap rc $?"; tail -12 "$OUT/overlap.log"
kill $VM
[ -n "${GPU_TESTS:-}" ] || exit 0
timeout 120 $PY -m pytest -q -rs -p no:cacheprovider -n 0 tests/test_gpu.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc $?"; tail -5 "$OUT/gpu_tests.log"
