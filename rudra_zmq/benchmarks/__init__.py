"""``rudra-zmq bench``: what the transport, the parameter server and the alternatives can move.

One module per command, sharing :mod:`.common` (sizes, timing, statistics, output, the two
sides of a benchmark):

=============  ==============================================================================
``thr``        raw ZeroMQ throughput (libzmq ``local_thr`` figures), tcp/ipc/inproc, copy or not
``lat``        raw ZeroMQ latency (libzmq ``local_lat`` figures)
``pushpull``   the parameter server's own path in ps-lite's modes, beside raw ZeroMQ
``allreduce``  ``torch.distributed`` gloo allreduce (nccl-tests figures) beside a hardsync step
``kernels``    the update kernels beside NumPy, torch and a plain copy
=============  ==============================================================================

Nothing here is imported by the roles; torch and matplotlib are imported only by the
commands that need them, when they run.
"""
