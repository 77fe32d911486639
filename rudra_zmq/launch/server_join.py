"""A sharded run's end where no server could join the K servers' files into the run's
``weights.npy`` and ``ps_final.json`` (the last one died between writing its own and joining
them, or the servers ran on ranks or hosts of their own): the launcher joins them
(``roles/ps_shard_files.assemble``), or says where the weights are."""

from __future__ import annotations

import sys
import time

from ..roles.ps_shard_files import assemble
from ..roles.stats_final import final_done
from ..run_files import PS_FINAL_FILE, server_dir

ELSEWHERE_FILES_S = 10.0  # how long rank 0 waits for servers elsewhere to write their files
FILES_POLL_S = 0.2  # ... looking for them this often


def join_servers(cfg, run_dir, elsewhere: bool = False) -> None:
    """Join the servers' files of the run of ``cfg`` in ``run_dir`` once every server's are
    there, unless the run's ``ps_final.json`` already says training ended at
    ``train.epochs`` (a server, or an earlier call, joined them: the K files are not read and
    written again). ``elsewhere``: some servers ran on ranks of their own and write just
    after their ``done``, so wait up to ``ELSEWHERE_FILES_S`` for them, then say how to join
    them later. Best effort: says why it could not. Blocks for the files."""
    if cfg.architecture.servers <= 1 or final_done(run_dir, cfg.train.epochs) is not None:
        return
    deadline = time.monotonic() + (ELSEWHERE_FILES_S if elsewhere else 0)
    while True:
        try:
            joined = assemble(run_dir, cfg.architecture.servers, cfg.train.epochs)
        except (OSError, ValueError) as exc:
            print(f"rudra-zmq: could not join the servers' weights: {exc}", file=sys.stderr)
            return
        joined = joined or (run_dir / PS_FINAL_FILE).exists()  # here, or by a server
        if joined or time.monotonic() > deadline:
            break
        time.sleep(FILES_POLL_S)
    if not joined and elsewhere:
        print(
            f"rudra-zmq: the servers on ranks of their own left their weights on their "
            f"hosts ({server_dir(run_dir, 1).parent}/server-I there, not shared here): "
            f"copy those folders here, then `rudra-zmq run --resume {run_dir}` joins "
            "them into weights.npy",
            file=sys.stderr,
        )
