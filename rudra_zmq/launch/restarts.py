"""What the launcher does when one of its roles fails: restart it, leave it out, or stop the run.

With ``runtime.restart`` a role of ``RESTARTABLE[architecture.kind]`` is started again, at most
``runtime.max_restarts`` times per role: the PS from its newest checkpoint (``--resume``), the
statistics server within the same run (without ``--resume``: no new period of the run begins).
Rudra-adv*'s broadcast chain is not rebuilt, so under advstar only the data and statistics
servers come back. A tree node or learner that failed once every server it serves wrote
``ps_final.json`` saying training is done (a node's range's root; a learner's every server)
has finished: nothing waits for it, so it is not restarted (with restarts it would ask a root
that has gone for ever). A learner that failed once some of its servers (not all) wrote it is
restarted with ``--finished-in RUN_DIR``: a new learner holds none of a finished server's
range, which that server no longer serves (gone, or answering only STOP), so it takes those
ranges from the finished servers' final weights and trains the others' (without them it
would wait ``runtime.timeout_s`` for a server that has gone, fail, and be restarted again:
chaos soak seed 10). Without restarts a failed learner is left out while another learner
still trains (or finished: it was told STOP), a PS that failed after it wrote
``ps_final.json`` saying training is done (its final weights saved) ends the run with them,
and any other failure stops the run.

Pure: :func:`on_failure` says what to do and what to print; the launcher does it.
"""

from __future__ import annotations

from dataclasses import dataclass

RESTARTABLE = {
    "base": ("stats", "data", "ps", "learner"),
    "adv": ("stats", "data", "ps", "node", "learner"),
    "advstar": ("stats", "data"),
}  # the broadcast chain is not rebuilt (yet)


@dataclass(frozen=True)
class Verdict:
    """``action``: "restart" (with ``args``), "leave_out", "finished" (the run ends well
    without it) or "stop"; ``message``: the line
    the launcher prints after ``rudra-zmq: `` (None: nothing more to say)."""

    action: str
    message: str | None
    args: tuple[str, ...] = ()


def restart_args(role: str, args, finished_in=None) -> tuple[str, ...]:
    """The command-line arguments a restarted ``role`` gets: the PS resumes from its newest
    checkpoint; a statistics server always appends to the run's metrics, on the run's clock,
    and goes on in this run (no ``--resume``: no new period begins); a learner restarted
    after some servers finished takes their ranges from their files in ``finished_in`` (the
    run directory)."""
    args = list(args)
    if role == "ps" and "--resume" not in args:
        args.append("--resume")
    if role == "stats":
        args = [a for a in args if a != "--resume"]
    if role == "learner" and finished_in is not None and "--finished-in" not in args:
        args += ["--finished-in", str(finished_in)]
    return tuple(args)


def on_failure(
    cfg,
    label: str,
    role: str,
    args,
    restarts: int,
    others_going: bool,
    run_dir,
    final=None,
    serves: tuple[str, ...] = (),
    finished: tuple[str, ...] = (),
) -> Verdict:
    """What to do about the role ``label`` (``role``, started with ``args``) of the run of
    ``cfg`` in ``run_dir``, which failed after ``restarts`` restarts. ``others_going``:
    another learner is still training or finished well. ``final``: the ``done`` record that
    ``ps_final.json`` stands for (``end_files.final_done``) of the server(s) the role serves,
    labelled ``serves`` (a PS: itself; a tree node: its range's root; a learner: every
    server, the newest record), None unless each says training is done; ``finished``: the
    labels of those whose ``ps_final.json`` says so (some, or all). Pure."""
    runtime, kind = cfg.runtime, cfg.architecture.kind
    if role in ("node", "learner") and final is not None:
        whom = ", ".join(serves) or "its server"
        return Verdict(
            "finished",
            f"{label} failed after training ended for {whom} (ps_final.json: done at "
            f"epoch {final['epoch']:.2f}); it has nothing left to do and is not restarted",
        )
    if role == "ps" and final is not None and not runtime.restart:
        return Verdict(
            "finished",
            f"{label} failed after training ended (ps_final.json: done at timestamp "
            f"{final['ts']}, epoch {final['epoch']:.2f}, weights.npy saved); the run ends "
            "with those weights",
        )
    if runtime.restart and role in RESTARTABLE[kind]:
        if restarts >= runtime.max_restarts:
            return Verdict(
                "stop",
                f"{label} failed {restarts + 1} times (runtime.max_restarts="
                f"{runtime.max_restarts}); stopping the run",
            )
        how = " from its newest checkpoint" if role == "ps" else ""
        if role == "learner" and finished:  # their ranges: their final weights, in run_dir
            how = f" with {', '.join(finished)}'s final weights ({', '.join(finished)} finished)"
        return Verdict(
            "restart",
            f"restarting {label}{how} ({restarts + 1} of at most {runtime.max_restarts})",
            restart_args(role, args, run_dir if role == "learner" and finished else None),
        )
    if role == "learner" and not runtime.restart:
        if others_going:
            return Verdict(
                "leave_out",
                f"{label} is left out (runtime.restart is off); the "
                "run goes on with the other learners",
            )
        return Verdict("stop", "every learner has failed; stopping the run")
    if runtime.restart:
        return Verdict(
            "stop",
            f"{label} cannot be restarted with architecture.kind={kind}; "
            f"stopping the run (continue it with `rudra-zmq run --resume "
            f"{run_dir}`)",
        )
    return Verdict("stop", None)
