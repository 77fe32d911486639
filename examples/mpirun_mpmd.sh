#!/bin/bash
# One rudra_zmq run under Open MPI, as an MPMD command line: one rank runs the servers, four
# run the learners of configs/quickstart.yaml. Open MPI numbers the ranks across the ':'
# groups (OMPI_COMM_WORLD_RANK), so rank 0 is the first group. The servers' host is passed
# with -x; HOSTS is an Open MPI host list such as "node1:1,node2:4". LEARNERS (default 4)
# must match the config's sync.learners. SERVERS=K (with --set architecture.servers=K) gives
# servers 1..K-1 ranks of their own, between rank 0 and the learners (ps-lite's order).
#   examples/mpirun_mpmd.sh node1 node1:1,node2:4
set -euo pipefail
SERVER=${1:?usage: $0 SERVER_HOST HOSTS [rudra-zmq worker options]}
HOSTS=${2:?usage: $0 SERVER_HOST HOSTS [rudra-zmq worker options]}
shift 2
W=(rudra-zmq worker configs/quickstart.yaml)
servers=()  # servers 1..K-1, one rank each
if ((${SERVERS:-1} > 1)); then servers=(-np $((SERVERS - 1)) "${W[@]}" --role server "$@" :); fi
mpirun --host "$HOSTS" -x RUDRA_MASTER_ADDR="$SERVER" -x PATH \
    -np 1 "${W[@]}" --role servers "$@" : \
    "${servers[@]}" \
    -np "${LEARNERS:-4}" "${W[@]}" --role learner "$@"
