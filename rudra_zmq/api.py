"""The Python API: ``train``, ``simulate`` and ``load_config`` (docs/api.md).

``train(config, overrides)`` does what ``rudra-zmq run`` does -- a run directory, every role
as its own process on this machine, supervised, all stopped at the end -- and returns a
``TrainResult`` read from the run directory, or raises ``TrainingError`` naming the role that
failed, with nothing left running. ``simulate`` runs the simulator in this process
(``rudra-zmq simulate``). A config is a YAML path, a dict (sections of keys, as in the file)
or a ``Config``; ``overrides`` is a dict of dotted keys, ``{"sync.learners": 8}``, checked as
``--set`` checks them.

Both functions block until the run ends and are not thread-safe: ``train`` sets
``PYTHONPATH`` in ``os.environ`` for its children while it runs (the folders this process
imported the config's user code from), redirects ``sys.stdout`` when ``quiet``, and, called
from the main thread, handles SIGINT/SIGTERM/SIGHUP itself until it returns (Ctrl-C stops
every role and raises KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from . import config as config_mod
from .config import Config, ConfigError
from .launch import launcher, preflight
from .launch.children import tail
from .launch.run_plan import make_plan, summary
from .results import compare
from .run_files import WEIGHTS_FILE, log_dir
from .sim import simulator
from .user_code import UserCodeError, import_root, is_import_path


class TrainingError(RuntimeError):
    """A run failed after its roles started; every one of them has been stopped.

    Attributes: ``run_dir``; ``role``, the label of the process whose failure ended the run
    (``learner0``, ``ps``, ...; None if the launcher named none); ``exit_code`` of that
    process; ``log``, its log file (else the run's ``logs/`` folder).
    """

    def __init__(
        self,
        message: str,
        run_dir: Path,
        role: str | None = None,
        exit_code: int | None = None,
        log: Path | None = None,
    ):
        super().__init__(message)
        self.run_dir, self.role, self.exit_code, self.log = run_dir, role, exit_code, log


@dataclass(frozen=True)
class TrainResult:
    """How a run (or simulation) ended, from what it wrote in ``run_dir``.

    ``final_error``/``best_error``: test error (0..1) at the end and the lowest seen (None
    without evaluations); ``epochs``: epochs of gradients trained; ``wall_s``: seconds of
    training (simulate: simulated seconds); ``mean_sigma``: ⟨σ⟩ over the run (None: no update).
    """

    run_dir: Path
    final_error: float | None
    best_error: float | None
    epochs: float | None
    wall_s: float | None
    mean_sigma: float | None

    def weights(self) -> np.ndarray:
        """The final weights (flat float32), read from ``run_dir/weights.npy``. Blocks."""
        return np.load(self.run_dir / WEIGHTS_FILE)


def load_config(config=None, overrides=None) -> Config:
    """A validated Config from ``config`` (a YAML path, a dict of sections, a Config, or None
    for the defaults) with ``overrides`` applied: a dict ``{"section.key": value}`` or a list
    of ``"section.key=value"`` strings, as ``--set`` takes them. Raises ConfigError naming the
    key and value (or FileNotFoundError). Imports the config's user code and checks it
    (``Config.validate``), which blocks while it builds the model and loads the data."""
    items = _override_items(overrides)
    if isinstance(config, Config):
        config = config_mod.to_dict(config)
    if isinstance(config, dict):
        flat = [f"{key}={_yaml(value)}" for key, value in config_mod.flat_keys(config).items()]
        return config_mod.load_config(None, flat + items)
    if config is not None and not isinstance(config, (str, os.PathLike)):
        raise ConfigError(
            f"a config is a YAML path, a dict or a Config, got {type(config).__name__}"
        )
    return config_mod.load_config(config, items)


def train(config, overrides=None, *, run_dir=None, quiet: bool = False) -> TrainResult:
    """Train as ``rudra-zmq run`` does: create a run directory (``run_dir``, else one under
    ``runtime.run_dir``), start every role as its own process on this machine, supervise
    them (restarting per ``runtime.restart``), stop them all at the end, and return the
    outcome. ``quiet``: print nothing (else the plan and one progress line per evaluation go
    to stdout, failures to stderr, as under ``rudra-zmq run``).

    Blocks until the run ends; not thread-safe (module docstring). Raises ConfigError before
    anything starts (no run directory) for a bad config (user code that does not import, or
    returns the wrong thing, included) or data that cannot be read (``preflight``);
    TrainingError if a role fails and the run cannot go on; KeyboardInterrupt if
    interrupted. Whatever it raises, no role is left running.
    """
    cfg = load_config(config, overrides)
    with _children_import(cfg), _silenced(quiet):
        preflight.run(cfg)  # data, extras; image data decoded once for every role
        plan = make_plan(cfg, run_dir)
        print(summary(plan), flush=True)
        runner = _Launcher(plan)
        rc = runner.run()
    if rc == 130:
        raise KeyboardInterrupt(
            f"training interrupted; every role was stopped (run directory {plan.run_dir})"
        )
    if rc != 0:
        raise runner.error(rc)
    r = compare.run_summary(plan.run_dir)
    return TrainResult(
        plan.run_dir, r["final_error"], r["best_error"], r["epochs"], r["wall_s"], r["mean_sigma"]
    )


def simulate(
    config,
    overrides=None,
    *,
    train: bool = False,
    jitter: float = 0.0,
    speeds=None,
    seed: int = 0,
    run_dir=None,
    quiet: bool = False,
) -> TrainResult:
    """Simulate a Rudra-base run of ``config`` in this process, as ``rudra-zmq simulate``
    does, write its run directory (``run_dir``, else ``runtime.run_dir/NAME-sim-STAMP``) and
    return the outcome. ``train``: real gradients and test error (else only the protocol, and
    the errors are None); ``jitter``, ``speeds``, ``seed``: the simulated learner timing
    (``simulator.simulate``); unless ``quiet``, one line per evaluation goes to stdout. With
    ``train`` the final weights are saved as ``weights.npy``.

    Blocks (computes on this process's torch threads); not thread-safe. Raises ConfigError for
    a bad config, ValueError for bad timing arguments.
    """
    cfg = load_config(config, overrides)
    path = (
        Path(run_dir)
        if run_dir is not None
        else Path(cfg.runtime.run_dir) / (f"{cfg.name}-sim-{time.strftime('%Y%m%d-%H%M%S')}")
    )
    res = simulator.simulate(
        cfg,
        speeds=speeds,
        jitter=jitter,
        seed=seed,
        train=train,
        progress=None if quiet else (lambda line: print(line, flush=True)),
    )
    path = simulator.write_run(cfg, res, path)
    if res.weights is not None:
        np.save(path / WEIGHTS_FILE, res.weights)
    errors = [e["test_error"] for e in res.evals]
    return TrainResult(
        path,
        errors[-1] if errors else None,
        min(errors) if errors else None,
        res.updates[-1]["epoch"] if res.updates else None,
        res.sim_time,
        res.mean_staleness if res.updates else None,
    )


# ------------------------------------------------------------------------------- helpers
class _Launcher(launcher.Launcher):
    """The launcher, remembering which child's failure it reported (the last one reported
    is the one that ended the run), so that ``train`` can name it."""

    def __init__(self, plan):
        super().__init__(plan)
        self.reported = []

    def _report(self, child, early: bool = False) -> None:
        self.reported.append(child)
        super()._report(child, early)

    def error(self, rc: int) -> TrainingError:
        """The TrainingError of a run that ended with exit code ``rc``."""
        run_dir = self.plan.run_dir
        if not self.reported:
            return TrainingError(
                f"training failed (exit code {rc}); the logs are in {log_dir(run_dir)}",
                run_dir,
                log=log_dir(run_dir),
            )
        child = self.reported[-1]
        lines = "\n".join(f"    {line}" for line in tail(child.log))
        return TrainingError(
            f"training failed: {child.describe_exit()}; its log is {child.log}"
            + (f", which ends:\n{lines}" if lines else ""),
            run_dir,
            child.label,
            child.proc.returncode,
            child.log,
        )


@contextlib.contextmanager
def _children_import(cfg):
    """Put the folders this process imported the config's user code from at the front of
    PYTHONPATH while the block runs, so that the roles (other processes) import it too."""
    roots = [import_root(v) for v in (cfg.model.name, cfg.data.dataset) if is_import_path(v)]
    before = os.environ.get("PYTHONPATH")
    parts = [r for r in roots if r] + ([before] if before else [])
    if parts:
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


@contextlib.contextmanager
def _silenced(quiet: bool):
    """Send stdout and stderr (the launcher's and the progress echo's) to /dev/null."""
    if not quiet:
        yield
        return
    with (
        open(os.devnull, "w") as null,
        contextlib.redirect_stdout(null),
        contextlib.redirect_stderr(null),
    ):
        yield


def _override_items(overrides) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        return [f"{key}={_yaml(value)}" for key, value in overrides.items()]
    if isinstance(overrides, (list, tuple)) and all(isinstance(o, str) for o in overrides):
        return list(overrides)
    raise ConfigError(
        f"overrides are a dict {{'section.key': value}} or a list of "
        f"'section.key=value' strings, got {overrides!r}"
    )


def _yaml(value) -> str:
    # one line of YAML that safe_load reads back as ``value`` (strings quoted where needed)
    text = yaml.safe_dump(value, default_flow_style=True, width=sys.maxsize).strip()
    return text[: -len("\n...")] if text.endswith("\n...") else text


__all__ = [
    "train",
    "simulate",
    "load_config",
    "TrainResult",
    "TrainingError",
    "ConfigError",
    "UserCodeError",
    "Config",
]
