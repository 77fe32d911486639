"""``rudra-zmq bench``: every benchmark of the project, one command each (:mod:`.cli`).

Communication and kernels (sharing :mod:`.common`: sizes, timing, statistics, output, and
:mod:`.sides`: the two sides of a benchmark across hosts):

==================  =========================================================================
``thr``             raw ZeroMQ throughput (libzmq ``local_thr`` figures), tcp/ipc/inproc
``lat``             raw ZeroMQ latency (libzmq ``local_lat`` figures)
``pushpull``        the PS's own path in ps-lite's modes, beside an echo server and raw ZeroMQ
``allreduce``       ``torch.distributed`` gloo allreduce (nccl-tests figures) beside hardsync
``kernels``         the update kernels beside NumPy, torch and a plain copy
``shm-leaf``        a tree leaf and its learners over ipc:// and over shared memory
==================  =========================================================================

Architectures and whole runs:

====================  =======================================================================
``root-ingress``      bytes the root receives per update, Rudra-base / adv / adv*, loopback
``lan-table1``        the paper's Table 1 on emulated LAN hosts (``bench/lan/netns.sh``)
``train-throughput``  ``rudra-zmq run`` images/s beside a plain PyTorch loop
``epoch-time``        seconds per epoch of config files
``sim-speed``         the simulator beside one learner process
``memory``            peak RSS/PSS/USS of whole runs
====================  =======================================================================

Nothing here is imported by the roles; torch, psutil and matplotlib are imported only by the
commands that need them, when they run.
"""
