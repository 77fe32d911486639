"""Where a role computes: ``runtime.device`` (a learner's CPU or GPU), and on how many threads
(``runtime.threads_per_learner``, ``runtime.ps_threads``).

- ``cpu`` (the default): the model, its flat buffers and the minibatches stay in host memory;
  the pushed gradient and the received weights are the model's own buffers (no copy).
- ``cuda``: learner i computes on GPU ``i mod (number of visible GPUs)``, so λ learners spread
  over a host's GPUs (restrict them with ``CUDA_VISIBLE_DEVICES``); ``cuda:N``: every learner
  of this config on GPU N. The model and its flat buffers live on the GPU; after each backward
  pass the flat gradient is copied to a pinned host buffer in one transfer (that buffer is what
  goes on the wire), and received weights are copied into the GPU's flat weights in one
  transfer (``flat.FlatModel``). The parameter server, the data server and the statistics
  server are unchanged: they never touch a GPU.

Threads: a learner runs ``threads_per_learner`` torch threads, or the cores this process may
use over the learners on its host (:func:`learner_threads`; ``rudra-zmq replay`` uses the same
count, so that its gradients are the learners' bit for bit); the PS's kernels run
:func:`ps_threads`.

Pure functions (they read the environment and the CPU affinity); thread-safe.
"""

from __future__ import annotations

import os
import re

_NAME = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_device_name(name: str) -> None:
    """Raise ValueError unless ``name`` is cpu, cuda or cuda:N (a syntax check: whether that
    GPU exists is checked where the learner starts, by ``learner_device``)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"runtime.device is {name!r}; expected cpu, cuda (learner i on GPU "
            "i mod the number of GPUs) or cuda:N"
        )


def learner_device(name: str, learner_id: int):
    """The ``torch.device`` learner ``learner_id`` computes on for ``runtime.device`` ``name``.

    Raises RuntimeError naming the value and what to do when it asks for a GPU that torch
    cannot use here (a CPU-only torch build, no driver, or N beyond the GPUs visible).
    """
    import torch

    check_device_name(name)
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"runtime.device={name}: torch {torch.__version__} sees no CUDA GPU on this host "
            f"(built for CUDA {torch.version.cuda or 'none: a CPU-only build'}). Run the "
            "learners with runtime.device=cpu, or install a CUDA build of torch where a GPU "
            "and its driver are present"
        )
    count = torch.cuda.device_count()
    index = learner_id % count if name == "cuda" else int(name.split(":")[1])
    if index >= count:
        raise RuntimeError(
            f"runtime.device={name}: this host has {count} visible CUDA GPU(s) "
            f"(0..{count - 1}); use cuda or cuda:0..cuda:{count - 1}"
        )
    return torch.device("cuda", index)


HOST_LEARNERS_ENV = "RUDRA_ZMQ_HOST_LEARNERS"  # learners the launcher placed on this host


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (a SLURM cpuset, ``taskset``),
    else every core."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def host_learners(cfg, default: int | None = None) -> int:
    """How many learners share this host: what the launcher said (``RUDRA_ZMQ_HOST_LEARNERS``),
    else ``default`` (a hand-started learner: its own ``--id`` count), else λ (every learner
    here, as under ``rudra-zmq run``)."""
    said = os.environ.get(HOST_LEARNERS_ENV, "")
    if said.isdigit() and int(said) > 0:
        return int(said)
    return default or cfg.sync.learners


def learner_threads(cfg, learners_here: int | None = None) -> int:
    """Torch threads per learner: runtime.threads_per_learner, or the usable cores over the
    learners on this host (:func:`host_learners`), at least 1."""
    if cfg.runtime.threads_per_learner:
        return cfg.runtime.threads_per_learner
    return max(1, usable_cores() // (learners_here or host_learners(cfg)))


def ps_threads(cfg) -> int:
    """OpenMP threads for the parameter server's kernels: runtime.ps_threads, else what the
    launcher chose for a PS sharing its machine with learners (RUDRA_ZMQ_PS_THREADS), else all
    usable cores (a PS started by hand on its own host)."""
    return (
        cfg.runtime.ps_threads or int(os.environ.get("RUDRA_ZMQ_PS_THREADS", 0)) or usable_cores()
    )
