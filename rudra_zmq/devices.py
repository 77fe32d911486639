"""Where a learner computes: ``runtime.device``.

- ``cpu`` (the default): the model, its flat buffers and the minibatches stay in host memory;
  the pushed gradient and the received weights are the model's own buffers (no copy).
- ``cuda``: learner i computes on GPU ``i mod (number of visible GPUs)``, so λ learners spread
  over a host's GPUs (restrict them with ``CUDA_VISIBLE_DEVICES``); ``cuda:N``: every learner
  of this config on GPU N. The model and its flat buffers live on the GPU; after each backward
  pass the flat gradient is copied to a pinned host buffer in one transfer (that buffer is what
  goes on the wire), and received weights are copied into the GPU's flat weights in one
  transfer (``flat.FlatModel``). The parameter server, the data server and the statistics
  server are unchanged: they never touch a GPU.

Pure functions; thread-safe.
"""

from __future__ import annotations

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
