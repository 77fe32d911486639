"""One typed configuration, loaded once from YAML (``yaml.safe_load``) into dataclasses.

Unknown keys and wrong types are errors that quote the key, the value and what is allowed;
``--set section.key=value`` overrides must name existing keys (values parse as YAML, so
``optimizer.lr_steps=[120,130]`` is a list). The resolved config is saved in every run dir.
All defaults are visible here, in one place; the strict loading itself is ``typed_yaml.py``
(``ConfigError`` is defined there and raised by both).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import yaml

from . import shipped
from .config_architecture import validate_architecture
from .devices import check_device_name
from .sync import LR_POLICIES, LRSchedule, check_protocol
from .sync.stages import check_target, parse_schedule
from .typed_yaml import ConfigError, apply_override, build, one_of, read_mapping
from .user_code import UserCodeError, is_import_path
from .wire_kinds import WIRE_DTYPES


@dataclass
class ModelConfig:
    name: str = "digits_cnn"  # cifar10_full | digits_cnn | alexnet | mlp, or your
    #                                    own: package.module:function (models.py)
    seed: int = 0  # initial weights (the PS builds them)


@dataclass
class DataConfig:
    dataset: str = "digits"  # digits | cifar10 | imagefolder | synthetic, or your
    #                                    own: package.module:function (datasets.py)
    root: str | None = None  # cifar-10-batches-py dir, ImageFolder tree or .tar.gz
    download: bool = False  # torchvision download (needs internet)
    image_size: int | None = None  # imagefolder resize/crop (default 224)
    synthetic_shape: list[int] = field(default_factory=lambda: [3, 32, 32])
    synthetic_train: int = 4096
    synthetic_test: int = 512
    num_classes: int = 10
    limit_per_class: int | None = None  # keep the first n images of each class per split
    augment: bool = False  # random crop + horizontal flip on the learner
    prefetch: int = 2  # minibatches each learner keeps in flight


@dataclass
class SyncConfig:
    protocol: str = "hardsync"  # sync.PROTOCOLS: hardsync | softsync | async
    n: int = 1  # the n of n-softsync (c = floor(learners / n))
    learners: int = 4  # λ
    batch_size: int = 32  # µ, per learner
    max_staleness: int | None = None  # bounded staleness s (softsync/async): σ <= s; null: none
    schedule: list[str] = field(default_factory=list)  # "EPOCH PROTOCOL [N]": from EPOCH on
    target_staleness: float | None = None  # softsync: n chosen to hold <σ> near this


@dataclass
class OptimizerConfig:
    lr: float = 0.05  # α0
    lr_policy: str = "constant"  # sync.LR_POLICIES: constant | staleness (α0/<σ>) |
    #                                    per_gradient
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_steps: list[float] = field(default_factory=list)  # epochs where α0 *= lr_gamma
    lr_gamma: float = 0.1
    param_multipliers: bool = True  # Caffe per-layer lr_mult/decay_mult where the model has them


@dataclass
class TrainConfig:
    epochs: float = 10.0
    eval_every_epochs: float = 1.0  # test error this often (0 = never by epoch)
    eval_every_updates: int = 0  # and/or every k updates (0 = off)
    seed: int = 0  # data order
    checkpoint_every_s: float = 60.0  # PS state to RUN_DIR/checkpoints this often (0 = off)
    checkpoint_every_updates: int = 0  # and/or every k updates (0 = off); always at the end
    schedule_scale: float = 1.0  # a record: epochs and lr_steps are this fraction of the
    #                                    config's own (--schedule-scale; scale_schedule)


@dataclass
class RuntimeConfig:
    host: str = "127.0.0.1"  # address the servers bind and learners connect to
    transport: str = "tcp"  # tcp | ipc (same host only)
    run_dir: str = "runs"  # parent folder of run directories
    threads_per_learner: int = 0  # torch threads per learner; 0 = cores / λ, at least 1
    ps_threads: int = 0  # kernel OpenMP threads on the PS; 0 = all cores for a
    #                                    PS started by hand, what the learners leave under run
    chunk_mib: int = 8  # max payload frame size for model-sized messages
    sndbuf_kib: int = 0  # the kernel send buffer of each learner-server TCP connection
    #                                    (both ends); 0 = the kernel's autotuning (docs/wire.md)
    timeout_s: float = 120.0  # a peer silent this long is an error, not a hang
    learner_timeout_s: float = 60.0  # the PS evicts a learner silent this long (0 = never);
    #                                    set above the slowest step; it rejoins with a HELLO
    retry_s: float = 5.0  # a client asks about a request unanswered this long (a header),
    #                       and sends it again only if the server never got it
    heartbeat_s: float = 2.0  # TCP keepalive idle and probe interval; dropped after 5 probes
    restart: bool = True  # rudra-zmq run restarts a crashed role
    max_restarts: int = 3  # restarts of one role; its next failure stops the run
    learners_per_process: int = 1  # >1 hosts several learner threads per process
    compute_times: list[float] = field(default_factory=list)  # per learner, >= 1: learner i
    #                                    takes this many times its real backward (it sleeps the
    #                                    rest): stragglers, as `simulate --speeds`; [] = all 1
    device: str = "cpu"  # learners compute on: cpu | cuda (learner i on GPU
    #                                    i mod #GPUs) | cuda:N (rudra_zmq/devices.py)


@dataclass
class ArchitectureConfig:
    kind: str = "base"  # base (one PS) | adv (a tree of PS nodes, Rudra-adv) |
    #                                    advstar (adv + weights broadcast through the learners)
    fanout: int = 4  # adv: learners per leaf and children per inner node
    depth: int = 1  # adv: node levels below the root (1: leaves -> root)
    leaves: list[list[int]] = field(default_factory=list)  # adv: learners per leaf (default:
    #                                    consecutive groups of fanout)
    broadcast_fanout: int = 1  # advstar: members each member forwards to (1: a chain)
    relay: str = "eager"  # adv/advstar softsync: eager (relay what is pending when
    #                                    no relay is in flight) | gather (relay whole subtrees)
    leaf_shm: bool = False  # adv/advstar: a leaf and its learners on one host trade
    #                                    gradients and weights through /dev/shm (rudra_zmq/shm.py;
    #                                    ipc/tcp where it is unavailable)
    servers: int = 1  # base: parameter servers, each serving one contiguous range of the
    #                                    flat vector with its own timestamp (docs/architecture.md)


@dataclass
class WireConfig:
    gradient_dtype: str = "float32"  # gradients (and tree nodes' sums) on the wire: float32 |
    #                                    float16 | bfloat16 (the PS sums and updates in float32)
    weights_dtype: str = "float32"  # weights the PS sends: float32 | float16 | bfloat16
    #                                    (the PS keeps float32 master weights; so do checkpoints)
    error_feedback: bool = True  # half gradients: each one's rounding error is added to the
    #                                    sender's next (nothing lost, only delayed a step)
    parts: int = 1  # hardsync: each server's range in P parts, each answered once every
    #                                    learner's part is in, while later parts still arrive
    #                                    (push and pull overlapped on the link; docs/wire.md)
    bucket_mb: float = 25.0  # with parts: no part larger than this many MiB (more parts
    #                                    where a range is larger; DDP's bucket_cap_mb). A
    #                                    learner pushes each part as backward completes it
    push_during_backward: bool = True  # with parts or K servers, a learner on CPU with
    #                                    float32 gradients pushes each part the moment its
    #                                    backward pass finished it (false: all after backward)
    priority: bool = False  # with parts pushed during backward: the lowest offsets (first
    #                                    layers) go first, and the next forward runs each
    #                                    layer once its weights are in (P3; learner/priority.py)
    stripes: bool = True  # with parts and K servers: the vector cut in K x P parts, part j to
    #                                    server j mod K, so every link starts with backward's
    #                                    first buckets (false: server I one contiguous range,
    #                                    the layout of checkpoints written before stripes)


@dataclass
class SecurityConfig:
    curve: bool | None = None  # CurveZMQ on every socket, allow-listed client keys
    #                                    (docs/security.md); `rudra-zmq run` makes per-run keys.
    #                                    null: on where others can reach the roles (`launch`
    #                                    beyond loopback, `worker` with security.keys), else off
    keys: str = ""  # by hand: the key directory (or each command's --keys)


@dataclass
class LoggingConfig:
    tensorboard: bool = False  # the stats server also writes RUN_DIR/tensorboard/
    #                                    (needs pip install 'rudra_zmq[tensorboard]')


@dataclass
class Config:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    architecture: ArchitectureConfig = field(default_factory=ArchitectureConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self, user_code: bool = True) -> Config:
        """Cross-field checks; raises ConfigError naming the value and what to do. With
        ``user_code`` false, a model or dataset named by import path is not imported (a
        saved run's config read back by ``compare`` or ``report``)."""
        s, o, r, d = self.sync, self.optimizer, self.runtime, self.data
        one_of("optimizer.lr_policy", o.lr_policy, LR_POLICIES)
        one_of("runtime.transport", r.transport, ("tcp", "ipc"))
        for key in ("gradient_dtype", "weights_dtype"):
            one_of(f"wire.{key}", getattr(self.wire, key), tuple(WIRE_DTYPES))
        if not is_import_path(d.dataset):
            one_of(
                "data.dataset",
                d.dataset,
                ("digits", "cifar10", "imagefolder", "synthetic", "package.module:function"),
            )
        try:
            check_protocol(s.protocol, s.n, s.learners, max_staleness=s.max_staleness)
            parse_schedule(s.schedule, s.learners)
            if s.target_staleness is not None:
                check_target(s.target_staleness, s.protocol, s.learners, s.schedule)
            check_device_name(r.device)
            LRSchedule(o.lr, o.lr_policy, tuple(o.lr_steps), o.lr_gamma)  # its own checks
        except ValueError as exc:
            raise ConfigError(f"optimizer: {exc}" if "lr" in str(exc) else str(exc)) from None
        for key, val, most in (
            ("sync.batch_size", s.batch_size, MAX_BATCH),
            ("sync.learners", s.learners, MAX_LEARNERS),
            ("data.num_classes", d.num_classes, MAX_CLASSES),
        ):
            if val > most:
                raise ConfigError(f"{key} is {val:,}: more than any run takes (at most {most:,})")
        for key, val in (
            ("sync.batch_size", s.batch_size),
            ("data.num_classes", d.num_classes),
            ("runtime.chunk_mib", r.chunk_mib),
            ("runtime.learners_per_process", r.learners_per_process),
        ):
            if val < 1:
                raise ConfigError(f"{key} must be >= 1, got {val}")
        if r.sndbuf_kib < 0:
            raise ConfigError(
                f"runtime.sndbuf_kib must be >= 0 (0: the kernel sizes it), got {r.sndbuf_kib}"
            )
        if not o.lr > 0:
            raise ConfigError(f"optimizer.lr must be > 0, got {o.lr}")
        if not 0 <= o.momentum < 1:
            raise ConfigError(f"optimizer.momentum must be in [0, 1), got {o.momentum}")
        if o.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
        if list(o.lr_steps) != sorted(o.lr_steps):
            raise ConfigError(f"optimizer.lr_steps must be ascending, got {o.lr_steps}")
        if not self.train.epochs > 0:
            raise ConfigError(f"train.epochs must be > 0, got {self.train.epochs}")
        check_schedule_scale(self.train.schedule_scale, "train.schedule_scale")
        if d.limit_per_class is not None and d.limit_per_class < 1:
            raise ConfigError(
                f"data.limit_per_class must be >= 1 (or null for all), got {d.limit_per_class}"
            )
        if len(d.synthetic_shape) != 3 or min(d.synthetic_shape) < 1:
            raise ConfigError(f"data.synthetic_shape must be [C, H, W], got {d.synthetic_shape}")
        if r.timeout_s <= 0:
            raise ConfigError(f"runtime.timeout_s must be > 0, got {r.timeout_s}")
        for key, val in (
            ("runtime.threads_per_learner", r.threads_per_learner),
            ("runtime.ps_threads", r.ps_threads),
        ):
            if not 0 <= val <= MAX_THREADS:
                raise ConfigError(f"{key} must be in 0..{MAX_THREADS} (0 = automatic), got {val}")
        for key, val in (
            ("runtime.learner_timeout_s", r.learner_timeout_s),
            ("runtime.heartbeat_s", r.heartbeat_s),
            ("runtime.max_restarts", r.max_restarts),
            ("train.checkpoint_every_s", self.train.checkpoint_every_s),
            ("train.checkpoint_every_updates", self.train.checkpoint_every_updates),
            ("train.eval_every_epochs", self.train.eval_every_epochs),
            ("train.eval_every_updates", self.train.eval_every_updates),
        ):
            if val < 0:
                raise ConfigError(f"{key} must be >= 0 (0 = off), got {val}")
        if not r.retry_s > 0:
            raise ConfigError(f"runtime.retry_s must be > 0, got {r.retry_s}")
        if r.compute_times and (
            len(r.compute_times) != s.learners or not all(t >= 1 for t in r.compute_times)
        ):
            raise ConfigError(
                f"runtime.compute_times must give a factor >= 1 for each of the {s.learners} "
                f"learners (or be [] for none), got {list(r.compute_times)}"
            )
        validate_architecture(self)
        if user_code:
            self._validate_user_code()
        return self

    def _validate_user_code(self) -> None:
        """model.name or data.dataset naming your code (``package.module:function``): import
        it, call the data function and build the model once for the data's shape, so that a
        path that does not import or a function that returns the wrong thing stops here,
        before any role starts. Blocks while it does; each is done once per process."""
        d = self.data
        if "." in self.model.name and not is_import_path(self.model.name):
            raise ConfigError(
                f"model.name {self.model.name!r} is neither a built-in model nor "
                "an import path: write package.module:function, with a colon "
                "before the function"
            )
        if not (is_import_path(self.model.name) or is_import_path(d.dataset)):
            return
        # torch and the user's modules: imported only for a config that names user code
        from . import models
        from .data import datasets

        try:
            shape = datasets.dataset_shape(d)
            if is_import_path(d.dataset):
                classes = datasets.user_data_info(d.dataset, d.root)[2]
                if classes > d.num_classes:
                    raise ConfigError(
                        f"data.num_classes is {d.num_classes} but data.dataset "
                        f"{d.dataset!r} has {classes} classes; set "
                        f"data.num_classes={classes}"
                    )
            if is_import_path(self.model.name):
                models.check_model(self.model.name, d.num_classes, shape)
                models.input_transform(self.model.name)
        except UserCodeError as exc:
            raise ConfigError(str(exc)) from exc


MAX_THREADS = 4096  # threads per process: beyond any machine (torch takes an int32)
MAX_BATCH = 2**20  # samples per minibatch (µ): a larger one is a damaged config, not a run
MAX_LEARNERS = 2**16  # λ
MAX_CLASSES = 2**20  # a model's outputs: more is a damaged config (the last layer would not fit)

# Keys of earlier releases, and why they went (bench/RESULTS.md has the measurements).
REMOVED_KEYS = {
    "runtime.hot_path": "the compiled PS path gave 1.08x end to end, under the 1.2x it had to earn",
    "runtime.stream_parts": "weights and gradients in parts gave no gain with 4 learners on a LAN",
    "runtime.gradient_parts": "weights and gradients in parts gave no gain with 4 learners on a LAN",
    "optimizer.momentum_policy": "the staleness-aware momentum learned slower than the paper's "
    "constant momentum (docs/reproduction.md, the lag grid)",
}
# Removed keys a run saved before they went still loads with: the value that behaves as now.
KEPT_VALUES = {"optimizer.momentum_policy": "constant"}
# Keys added since simulator checkpoints were fingerprinted, with the default that behaves as
# before they came: at it they are left out of a fingerprint (sim_checkpoint.fingerprint).
ADDED_DEFAULTS = {
    "architecture.servers": 1,
    "wire.parts": 1,
    "wire.bucket_mb": 25.0,
    "wire.push_during_backward": True,
    "wire.stripes": True,
    "wire.priority": False,
}


def load_config(
    path: str | os.PathLike | None = None, overrides=(), *, user_code: bool = True
) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None), apply ``key=value``
    overrides, type-check and validate it (``user_code`` false: without importing a model or
    dataset named by import path, ``Config.validate``). A bare name (no ``/``, no ``.yaml``)
    that is not a file here is a built-in config, as is ``configs/NAME.yaml`` where no such
    file is here (:mod:`rudra_zmq.shipped`). Raises ConfigError /
    FileNotFoundError (a ConfigError names the file, and the overrides given with it)."""
    if path is not None:
        text = os.fspath(path)
        path = shipped.resolve("config", text)
        if path is None:
            raise ConfigError(shipped.unknown("config", text))
    data = read_mapping(path, "config file", "configs/") if path is not None else {}
    try:
        for item in overrides:
            apply_override(Config, data, item, REMOVED_KEYS)
        return build(Config, data, "", REMOVED_KEYS, KEPT_VALUES).validate(user_code)
    except ConfigError as exc:  # say which file (a run's saved config.yaml, handed back)
        if path is None:
            raise
        given = f" with --set {' '.join(overrides)}" if overrides else ""
        raise ConfigError(f"{path}{given}: {exc}") from None


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def flat_keys(data: dict, prefix: str = "") -> dict:
    """``{"sync": {"learners": 8}}`` -> ``{"sync.learners": 8}``: nested sections as the
    dotted keys ``--set`` takes, in order. Pure."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def dump(config: Config) -> str:
    """The resolved config as YAML text (every key, defaults included)."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def save(config: Config, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        f.write(dump(config))


def check_schedule_scale(scale, what: str = "--schedule-scale") -> None:
    """Raise ConfigError, naming the value, unless 0 < ``scale`` <= 1. Pure."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1:
        raise ConfigError(
            f"{what} must be a fraction in (0, 1] of the schedule, got {scale!r} "
            "(0.1: a tenth of the epochs, the lr steps at a tenth of theirs)"
        )


def scale_schedule(path, overrides, scale: float) -> list[str]:
    """The overrides that scale the schedule of ``path`` with ``overrides`` by ``scale``:
    ``train.epochs`` and every ``optimizer.lr_steps`` epoch times ``scale``, and
    ``train.schedule_scale`` (the record ``report`` shows) times ``scale``. Append them
    after ``overrides``. Raises ConfigError for a bad scale. Blocks on reading the config."""
    check_schedule_scale(scale)
    cfg = load_config(path, overrides)
    steps = [round(s * scale, 6) for s in cfg.optimizer.lr_steps]
    return [
        f"train.epochs={round(cfg.train.epochs * scale, 6)}",
        f"optimizer.lr_steps={steps}",
        f"train.schedule_scale={round(cfg.train.schedule_scale * scale, 6)}",
    ]
