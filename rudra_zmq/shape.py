"""The cluster's shape: the one object that knows a run's parameter servers (ps-lite's
``Postoffice``).

A run has K = ``architecture.servers`` parameter servers, each serving a *share* of the
model's flat vector (:class:`Share`). Without parts (``wire.parts`` 1) server I's share is the
I-th contiguous range (:func:`split`: sizes differing by at most one). With parts the vector is
cut in K x P parts (P = ``wire.parts``, more where one would pass ``wire.bucket_mb``:
:func:`parts_in`) and part j goes to server j mod K (``wire.stripes``, BytePS's layout): every
layer is spread over every server, so the buckets backward finishes first (the last layers')
reach every server's link at once, and the first layers' (finished last, needed first) too. A
server keeps its stripes end to end (its *local* vector); a part's ``at`` is its offset there::

        striped, K = 2 servers, wire.parts = 3: numel floats in 6 parts
    | s0 p0 | s1 p0 | s0 p1 | s1 p1 | s0 p2 | s1 p2 |      the flat vector
    server 0's local vector: | s0 p0 | s0 p1 | s0 p2 |     (at = 0, |p0|, |p0|+|p1|)

        wire.stripes false (runs before stripes; their checkpoints restore under it)
    |<------------- server 0 ------------->|<------------- server 1 ------------->|
    | part 0     | part 1     | part 2     | part 3     | part 4     | part 5     |

A learner reaches each server directly (Rudra-base) or through the leaf of that range's tree
(Rudra-adv, one tree per range; trees carry no parts, so their shares are ranges). One server
is a set of one: its share is the whole vector, the same way either layout.

Built once from the config (:meth:`ClusterShape.of`); what depends on the model's size (the
ranges and the parts) once that size is known (:meth:`ClusterShape.sized`: the learner and the
statistics server build the model, the PS its initial weights, a tree node hears it in its
first child's HELLO). What it answers:

- the shares: a server's stripes (each ``[lo, hi)`` of the flat vector, a :class:`Span`) as a
  :class:`Share`. The optimizer's parameter segments (per-layer learning-rate and weight-decay
  multipliers) are per element, so a segment that crosses a stripe's boundary is clipped to
  it (:meth:`Share.clip`): each server updates its elements exactly as one server of the
  whole vector would (hardsync's weights are the same bit for bit in either layout);
- the servers (:attr:`ClusterShape.servers`, each a :class:`Server`: index, launcher label,
  share, parts, host) and every part (:attr:`ClusterShape.parts`, each a :class:`Part`:
  index in the vector's order, server, ``[lo, hi)`` in the flat vector, ``at`` in the
  server's local vector; :meth:`ClusterShape.parts_of`,
  :meth:`ClusterShape.covering`);
- where each server's files go in a run directory (:meth:`Server.files_dir`,
  :meth:`Server.checkpoint_dir`) and which of them are joined into the run's own end files
  (:meth:`ClusterShape.joined_dirs`);
- how each server names itself: its launcher label and command-line argument, the fields its
  records and EVALs carry, which server a record or an EVAL is from
  (:meth:`ClusterShape.record_server`, :meth:`ClusterShape.eval_server`);
- the tree plan (:attr:`ClusterShape.tree`; :meth:`ClusterShape.tree_processes`: one tree
  per range; :meth:`ClusterShape.first_hops`: where a learner connects, in range order) and
  each server's host (:meth:`ClusterShape.placed`).

One server keeps the layout runs had before servers had ranges: it writes the run's files
itself, its records and EVALs name no server, its command line has no ``--shard``. That is
the one place where the number of servers changes more than arithmetic (:func:`_alone`); no
caller asks it. Pure: no I/O, no sockets; immutable, thread-safe.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from . import topology
from .config_architecture import MAX_PARTS
from .run_files import checkpoints_root, server_dir
from .typed_yaml import ConfigError


# ---------------------------------------------------------------------- ranges
@dataclass(frozen=True)
class Span:
    """Elements ``lo`` up to (not including) ``hi`` of a flat vector of ``total`` floats."""

    lo: int
    hi: int
    total: int

    def __post_init__(self):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in self.astuple()):
            raise ValueError(f"range {self.astuple()!r}: lo, hi and total must be integers")
        if not 0 <= self.lo < self.hi <= self.total:
            raise ValueError(
                f"range [{self.lo}, {self.hi}) of a vector of {self.total} floats: "
                "it needs 0 <= lo < hi <= total (is the model the one the range "
                "was planned for?)"
            )

    @classmethod
    def whole(cls, numel: int) -> Span:
        """The whole vector of ``numel`` floats (what the one server of a run serves)."""
        return cls(0, numel, numel)

    @classmethod
    def from_meta(cls, value, total: int) -> Span:
        """The span a checkpoint's ``meta["range"]`` ([lo, hi]) names in a vector of ``total``
        floats; None (a checkpoint written before servers had ranges) is the whole vector.
        Raises ValueError for anything else."""
        if value is None:
            return cls.whole(total)
        if not isinstance(value, list) or len(value) != 2:
            raise ValueError(f"checkpoint range {value!r}: expected [lo, hi]")
        return cls(value[0], value[1], total)

    def astuple(self) -> tuple[int, int, int]:
        return self.lo, self.hi, self.total

    @property
    def numel(self) -> int:
        """How many floats the span holds."""
        return self.hi - self.lo

    @property
    def is_whole(self) -> bool:
        """Whether the span is the whole vector."""
        return self.lo == 0 and self.hi == self.total

    def clip(self, segments) -> list[tuple]:
        """The (start, stop, lr_mult, decay_mult) ``segments`` of the whole vector that overlap
        the span, clipped to it and shifted to offsets within it (0 is ``lo``)."""
        return [
            (max(a, self.lo) - self.lo, min(b, self.hi) - self.lo, *rest)
            for a, b, *rest in segments
            if a < self.hi and b > self.lo
        ]

    def __str__(self) -> str:
        whole = " (the whole vector)" if self.is_whole else ""
        return f"[{self.lo:,}, {self.hi:,}) of {self.total:,}{whole}"


def split(numel: int, k: int) -> list[Span]:
    """``k`` contiguous spans covering a vector of ``numel`` floats, sizes differing by at most
    one (the first ``numel % k`` one larger). Raises ValueError unless 1 <= k <= numel."""
    if not isinstance(k, int) or not 1 <= k <= numel:
        raise ValueError(f"cannot split {numel:,} floats into {k!r} ranges: give 1 to {numel:,}")
    size, extra = divmod(numel, k)
    bounds = [i * size + min(i, extra) for i in range(k + 1)]
    return [Span(a, b, numel) for a, b in itertools.pairwise(bounds)]


def part_bounds(numel: int, parts: int) -> list[int]:
    """The offsets cutting a range of ``numel`` floats into ``parts`` contiguous parts as
    :func:`split` sizes them (fewer when the range has fewer floats): ``[0, ..., numel]``.
    Learner and server compute them alike from ``wire.parts`` (``docs/wire.md``). Pure."""
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a whole number >= 1, got {parts!r}")
    return [s.lo for s in split(numel, min(parts, numel))] + [numel]


def parts_in(numel: int, parts: int, bucket_mb: float) -> int:
    """How many parts a range of ``numel`` floats travels in: 1 (whole messages) with
    ``wire.parts`` 1, else ``wire.parts``, more where a part would pass ``wire.bucket_mb``
    MiB of float32 (DDP's ``bucket_cap_mb``), at most ``MAX_PARTS``. Learner and server
    count alike. Pure."""
    if parts > 1:
        bucket = max(1, int(bucket_mb * (1 << 20)) // 4)
        parts = min(MAX_PARTS, max(parts, -(-numel // bucket)))
    return parts


@dataclass(frozen=True)
class Share:
    """A server's share of a flat vector of ``total`` floats: its ``stripes`` (disjoint
    :class:`Span` s, in the vector's order). The server keeps them end to end in one buffer of
    :attr:`numel` floats (its *local* vector: offset 0 is the first stripe's ``lo``); one
    stripe is a contiguous range, the layout of every run before stripes (and of every run
    without parts)."""

    stripes: tuple[Span, ...]

    def __post_init__(self):
        s = self.stripes
        if not s or any(a.total != s[0].total or a.hi > b.lo for a, b in itertools.pairwise(s)):
            raise ValueError(
                f"stripes {[x.astuple() for x in s]!r}: disjoint, in order, of one vector"
            )

    @classmethod
    def of(cls, lo: int, hi: int, total: int) -> Share:
        """The contiguous share ``[lo, hi)``."""
        return cls((Span(lo, hi, total),))

    @classmethod
    def whole(cls, numel: int) -> Share:
        """The whole vector of ``numel`` floats (what the one server of a run serves)."""
        return cls((Span.whole(numel),))

    @classmethod
    def from_key(cls, value, total: int) -> Share:
        """The share a :attr:`key` (a HELLO's, an EVAL's or a checkpoint's ``range``) names in a
        vector of ``total`` floats; None (a checkpoint written before servers had ranges) is the
        whole vector. Raises ValueError for anything else."""
        if value is None:
            return cls.whole(total)
        if not isinstance(value, list) or not value:
            raise ValueError(f"range {value!r}: expected [lo, hi] or [[lo, hi], ...]")
        pairs = value if isinstance(value[0], list) else [value]
        if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise ValueError(f"range {value!r}: expected [lo, hi] or [[lo, hi], ...]")
        return cls(tuple(Span(a, b, total) for a, b in pairs))

    @property
    def key(self) -> list:
        """How messages and checkpoints name it: ``[lo, hi]`` for a contiguous share (as
        before stripes), ``[[lo, hi], ...]`` for stripes. JSON-able, compared as it comes back."""
        if len(self.stripes) == 1:
            return [self.lo, self.stripes[0].hi]
        return [[s.lo, s.hi] for s in self.stripes]

    @property
    def total(self) -> int:
        return self.stripes[0].total

    @property
    def lo(self) -> int:
        """Where its first stripe begins."""
        return self.stripes[0].lo

    @property
    def numel(self) -> int:
        """How many floats it holds (its local vector's size)."""
        return sum(s.numel for s in self.stripes)

    @property
    def contiguous(self) -> bool:
        """Whether it is one range of the vector (its local vector is a view of the flat one)."""
        return len(self.stripes) == 1

    @property
    def is_whole(self) -> bool:
        """Whether it is the whole vector."""
        return self.contiguous and self.stripes[0].is_whole

    def placed(self) -> list[tuple[int, int, int]]:
        """(local offset, lo, hi) of each stripe. Pure."""
        out, at = [], 0
        for s in self.stripes:
            out.append((at, s.lo, s.hi))
            at += s.numel
        return out

    def clip(self, segments) -> list[tuple]:
        """The (start, stop, lr_mult, decay_mult) ``segments`` of the whole vector that overlap
        its stripes, clipped to each and shifted to offsets in the local vector."""
        out = []
        for at, lo, hi in self.placed():
            out += [
                (at + a, at + b, *rest) for a, b, *rest in Span(lo, hi, self.total).clip(segments)
            ]
        return out

    def gather(self, vector):
        """Its floats of the whole ``vector``, end to end: a view when contiguous, else a copy."""
        if self.contiguous:
            return vector[self.lo : self.stripes[0].hi]
        return np.concatenate([vector[s.lo : s.hi] for s in self.stripes])

    def scatter(self, local, vector) -> None:
        """Write its local vector ``local`` into its places in the whole ``vector``."""
        for at, lo, hi in self.placed():
            vector[lo:hi] = local[at : at + hi - lo]

    @property
    def dirname(self) -> str:
        """Its checkpoints' folder name: ``range-LO-HI``, ``stripes-LO-HI-xN`` (first stripe,
        count)."""
        first = self.stripes[0]
        if self.contiguous:
            return f"range-{first.lo}-{first.hi}"
        return f"stripes-{first.lo}-{first.hi}-x{len(self.stripes)}"

    def __str__(self) -> str:
        if self.contiguous:
            return str(self.stripes[0])
        a, b = self.stripes[0], self.stripes[-1]
        return (
            f"{len(self.stripes)} stripes [{a.lo:,}, {a.hi:,}) .. [{b.lo:,}, {b.hi:,}) "
            f"({self.numel:,} floats) of {self.total:,}"
        )


# ---------------------------------------------------------------------- the shape
def _alone(count: int) -> bool:
    """Whether a run of ``count`` servers keeps the layout of one (the module docstring)."""
    return count == 1


def _merged(pieces) -> list[tuple[int, int]]:
    """``pieces`` ((lo, hi), in order) with touching ones joined: a range's parts are one."""
    out: list[list[int]] = []
    for lo, hi in pieces:
        if out and out[-1][1] == lo:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return [(a, b) for a, b in out]


@dataclass(frozen=True)
class Part:
    """One part of the flat vector: ``index`` among every part of the run (in the vector's
    order), the ``server`` whose range holds it, its place ``[lo, hi)`` in the flat vector and
    ``at``, its offset in that server's range (what ``x{at}`` says on the wire)."""

    index: int
    server: int
    lo: int
    hi: int
    at: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Server:
    """Parameter server ``index`` of ``count``: its share of the flat vector (``share``, a
    :class:`Share`: one range, or stripes; None until the shape knows the model's size), the
    ``parts`` it travels in (empty until then; with stripes one per stripe) and its ``host``
    (None until placed)."""

    index: int
    count: int
    share: Share | None = None
    parts: tuple[Part, ...] = ()
    host: str | None = None

    @property
    def label(self) -> str:
        """The launcher's label: ``ps``, then ``ps1`` .. ``psK-1``."""
        return "ps" if self.index == 0 else f"ps{self.index}"

    @property
    def args(self) -> list[str]:
        """What its command line (and its tree nodes') says to pick it: ``--shard I``."""
        return [] if _alone(self.count) else ["--shard", str(self.index)]

    @property
    def name(self) -> str:
        """How a learner names it in a message: ``parameter server`` (``... I`` of several)."""
        return "parameter server" if _alone(self.count) else f"parameter server {self.index}"

    @property
    def of_range(self) -> str:
        """What a tree node of its range adds to its parent's name: `` of server I's range``."""
        return "" if _alone(self.count) else f" of server {self.index}'s range"

    def title(self) -> str:
        """Its name with its range, for its own start line (``parameter server 1 of 2 (range
        [5, 10) of 10)``)."""
        return (
            self.name if _alone(self.count) else f"{self.name} of {self.count} (range {self.share})"
        )

    @property
    def record(self) -> dict:
        """What each of its records to the statistics server adds: ``{"server": I}``."""
        return {} if _alone(self.count) else {"server": self.index}

    @property
    def eval_fields(self) -> dict:
        """What each of its EVALs adds: the share it holds, ``{"range": key}``
        (:attr:`Share.key`)."""
        return {} if _alone(self.count) else {"range": self._sized.key}

    @property
    def bounds(self) -> list[int]:
        """Its parts' offsets in its range, and the range's size: ``[0, ..., numel]``."""
        return [p.at for p in self.parts] + [self._sized.numel]

    @property
    def _sized(self) -> Share:
        if self.share is None:
            raise ValueError(
                f"server {self.index}'s range is not known before the model's size "
                "(ClusterShape.sized)"
            )
        return self.share

    def files_dir(self, run_dir) -> Path:
        """Where it writes ``weights.npy``, ``ps_final.json`` and ``arrivals.bin``: ``RUN``
        for the only server, ``RUN/servers/server-I`` for one of several."""
        return server_dir(run_dir, None if _alone(self.count) else self.index)

    def checkpoint_dir(self, run_dir) -> Path:
        """Where it keeps its checkpoints: ``RUN/checkpoints`` for the whole vector,
        ``RUN/checkpoints/range-LO-HI`` for a range of it (``stripes-...``:
        :attr:`Share.dirname`)."""
        root = checkpoints_root(run_dir)
        share = self._sized
        return root if share.is_whole else root / share.dirname


@dataclass(frozen=True)
class ClusterShape:
    """The run's servers, their ranges and parts, files, names, hosts and tree plan (the
    module docstring). ``numel`` None: the model's size is not known yet (ranges and parts
    are not); ``hosts``: each server's host once placed (``rudra-zmq launch``)."""

    count: int
    parts_per_range: int = 1  # wire.parts
    kind: str = "base"
    tree: topology.Tree | None = None
    numel: int | None = None
    hosts: tuple[str, ...] | None = None
    bucket_mb: float = 25.0  # wire.bucket_mb: no part larger (``parts_in``)
    stripes: bool = True  # wire.stripes: with parts, each server's parts spread over the vector

    @classmethod
    def of(cls, cfg, numel: int | None = None) -> ClusterShape:
        """The shape ``cfg`` plans (``architecture``, ``wire.parts``), sized when ``numel``
        (the model's size) is given. Raises ConfigError as :meth:`sized`. Pure."""
        a = cfg.architecture
        shape = cls(
            a.servers,
            cfg.wire.parts,
            a.kind,
            topology.tree_of(cfg),
            bucket_mb=cfg.wire.bucket_mb,
            stripes=cfg.wire.stripes,
        )
        return shape if numel is None else shape.sized(numel)

    def sized(self, numel: int) -> ClusterShape:
        """This shape for a model of ``numel`` floats. Raises ConfigError when it has more
        servers than the model has parameters (each serves at least one)."""
        if self.count > numel:
            raise ConfigError(
                f"architecture.servers={self.count} is more than the model's {numel:,} "
                "parameters; give each server at least one"
            )
        return replace(self, numel=numel)

    def check_size(self, model_numel) -> None:
        """Raise ConfigError unless the model fits the servers: ``model_numel()`` gives its
        size, asked only when there are several servers (any model fits one; building it to
        ask can take seconds)."""
        if self.count > 1:
            self.sized(model_numel())

    # ------------------------------------------------------------------ servers and parts
    @property
    def striped(self) -> bool:
        """Whether the servers' parts are stripes (``wire.stripes``, several servers, parts):
        the vector cut in K x P parts, part j to server j mod K."""
        return self.stripes and self.count > 1 and self.parts_per_range > 1

    @cached_property
    def servers(self) -> tuple[Server, ...]:
        """Every server, in index order."""
        hosts = self.hosts or (None,) * self.count
        if self.numel is None:
            return tuple(Server(i, self.count, None, (), h) for i, h in enumerate(hosts))
        if self.striped:
            cuts = self._striped()
        else:
            cuts = []
            for span in split(self.numel, self.count):
                p = parts_in(span.numel, self.parts_per_range, self.bucket_mb)
                cuts.append(
                    [
                        (span.lo + a, span.lo + b)
                        for a, b in itertools.pairwise(part_bounds(span.numel, p))
                    ]
                )
        rank = {lo: j for j, lo in enumerate(sorted(lo for pieces in cuts for lo, _ in pieces))}
        out = []
        for i, (pieces, host) in enumerate(zip(cuts, hosts)):
            parts, at = [], 0
            for lo, hi in pieces:
                parts.append(Part(rank[lo], i, lo, hi, at))
                at += hi - lo
            share = Share(tuple(Span(lo, hi, self.numel) for lo, hi in _merged(pieces)))
            out.append(Server(i, self.count, share, tuple(parts), host))
        return tuple(out)

    def _striped(self) -> list[list[tuple[int, int]]]:
        """Each server's parts as (lo, hi): the vector cut in K x P parts (:func:`split`), P as
        a range of numel / K would have (:func:`parts_in`), part j to server j mod K. Every
        layer's gradient is spread over the servers: backward's first buckets reach each link.
        A server's parts, end to end, cut as :func:`part_bounds` cuts its local vector (split
        makes the first parts the larger), so the server counts them as before. Pure."""
        k = self.count
        p = parts_in(-(-self.numel // k), self.parts_per_range, self.bucket_mb)
        p = max(1, min(p, self.numel // k))
        chunks = split(self.numel, k * p)
        return [[(c.lo, c.hi) for c in chunks[i::k]] for i in range(k)]

    def server(self, index: int) -> Server:
        """Server ``index``. Raises ValueError naming the servers there are."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.count:
            raise ValueError(
                f"server {index!r}: architecture.servers={self.count} numbers them "
                f"0..{self.count - 1}"
            )
        return self.servers[index]

    def pick(self, shard: int | None, what: str = "server") -> Server:
        """The server a command line's ``--shard`` names: required with several servers,
        0 or absent with one. Raises ValueError saying what to give."""
        if shard is None and not _alone(self.count):
            raise ValueError(
                f"architecture.servers={self.count}: give --shard I, the range this {what} "
                f"serves, 0..{self.count - 1} (got None)"
            )
        if shard not in (None, 0) and _alone(self.count):
            raise ValueError(
                f"--shard {shard}: the config has one parameter server "
                "(architecture.servers=1); --shard is 0 or absent"
            )
        try:
            return self.server(shard or 0)
        except ValueError:
            raise ValueError(
                f"architecture.servers={self.count}: give --shard I, the range this {what} "
                f"serves, 0..{self.count - 1} (got {shard})"
            ) from None

    @property
    def labels(self) -> list[str]:
        """The servers' launcher labels, in range order: ``ps``, ``ps1``, ..."""
        return [s.label for s in self.servers]

    def by_label(self, label: str) -> Server:
        """The server the launcher labels ``label``. Raises KeyError."""
        for s in self.servers:
            if s.label == label:
                return s
        raise KeyError(f"no parameter server is labelled {label!r} (servers: {self.labels})")

    @cached_property
    def parts(self) -> tuple[Part, ...]:
        """Every part of the flat vector, in its order (``Part.index``). Raises ValueError
        before the model's size is known."""
        if self.numel is None:
            raise ValueError("the parts are not known before the model's size (sized)")
        return tuple(sorted((p for s in self.servers for p in s.parts), key=lambda p: p.lo))

    def parts_of(self, server: int) -> tuple[Part, ...]:
        """The parts of server ``server``'s range, in order."""
        self.parts  # noqa: B018 (raises before the model's size is known)
        return self.server(server).parts

    def covering(self, lo: int, hi: int) -> list[Part]:
        """The parts that hold some of ``[lo, hi)`` of the flat vector, in order (a gradient
        bucket's parts). Raises ValueError for a range outside the vector."""
        parts = self.parts
        if not 0 <= lo <= hi <= self.numel:
            raise ValueError(f"[{lo}, {hi}) is not within the vector of {self.numel:,} floats")
        if lo == hi:
            return []
        first = bisect.bisect_right([p.lo for p in parts], lo) - 1
        last = bisect.bisect_left([p.lo for p in parts], hi)
        return list(parts[first:last])

    # ------------------------------------------------------------------ records and files
    def record_server(self, rec: dict) -> int | None:
        """The server a record to the statistics server comes from (it carries that server's
        :attr:`Server.record`), or None when it names none of this run's."""
        return self._match(rec, "record")

    def eval_server(self, fields: dict) -> int | None:
        """The server an EVAL's ``fields`` come from (its :attr:`Server.eval_fields`), or
        None when they name none of this run's ranges."""
        return self._match(fields, "eval_fields")

    def eval_record(self, timestamps: list[int]) -> dict:
        """What the record of an evaluation joined from every server's EVAL adds: each
        server's timestamp, ``{"server_ts": [...]}`` in range order."""
        return {} if _alone(self.count) else {"server_ts": list(timestamps)}

    def _match(self, fields: dict, what: str) -> int | None:
        for s in self.servers:
            if all(fields.get(k) == v for k, v in getattr(s, what).items()):
                return s.index
        return None

    def joined_dirs(self, run_dir) -> tuple[Path, ...]:
        """The servers' folders whose end files are joined into the run's own ``weights.npy``
        and ``ps_final.json``, in range order (``server/end_files.assemble``); none when the
        run's files are its one server's own."""
        if _alone(self.count):
            return ()
        return tuple(s.files_dir(run_dir) for s in self.servers)

    def join(self, weights: list) -> np.ndarray:
        """The whole flat vector from each server's local vector (``weights``, in index order):
        end to end for ranges, stripes put in place. Sizes itself from them when the model's
        size is not known. Raises ValueError when one has another size than its share."""
        shape = self if self.numel is not None else self.sized(sum(w.shape[0] for w in weights))
        if not shape.striped:
            return np.concatenate(weights)
        whole = np.empty(shape.numel, np.float32)
        for s, w in zip(shape.servers, weights, strict=True):
            if w.shape[0] != s.share.numel:
                raise ValueError(
                    f"{s.name}'s weights hold {w.shape[0]:,} floats; its share is {s.share}"
                )
            s.share.scatter(w, whole)
        return whole

    # ------------------------------------------------------------------ trees and hosts
    @staticmethod
    def node_label(node_id: int, server: int = 0) -> str:
        """The launcher's label of tree node ``node_id`` of server ``server``'s tree:
        ``node3``, and ``node3s1`` for the trees of ranges 1, 2, ..."""
        return f"node{node_id}" if server == 0 else f"node{node_id}s{server}"

    def tree_processes(self) -> list[tuple[str, topology.NodeSpec, int]]:
        """(label, node, server) of every tree node process: one tree per server's range,
        each in ``tree.nodes`` order; none without a tree."""
        if self.tree is None:
            return []
        return [
            (self.node_label(n.id, s.index), n, s.index)
            for s in self.servers
            for n in self.tree.nodes
        ]

    def first_hops(self, learner: int) -> list[str]:
        """The labels learner ``learner`` connects to, in range order: the servers, or its
        leaf in each range's tree."""
        if self.tree is None:
            return self.labels
        leaf = self.tree.leaf_of(learner).id
        return [self.node_label(leaf, s.index) for s in self.servers]

    def placed(self, ps_hosts, server_host: str, learner_hosts: list[str]) -> ClusterShape:
        """This shape with each server on a host, cycling through ``ps_hosts`` (``["learners"]``:
        the learners' hosts in order, each once; None or empty: ``server_host``)."""
        if not ps_hosts:
            cycle = itertools.cycle([server_host])
        elif list(ps_hosts) == ["learners"]:
            cycle = itertools.cycle(dict.fromkeys(learner_hosts))
        else:
            cycle = itertools.cycle(ps_hosts)
        return replace(self, hosts=tuple(itertools.islice(cycle, self.count)))

    def describe(self) -> list[str]:
        """Lines for a run's summary: how many servers (none for one)."""
        if _alone(self.count):
            return []
        return [
            f"{self.count} parameter servers ({', '.join(self.labels[:2])}, ...), each "
            "serving one range of the flat vector with its own timestamp"
        ]

    def describe_trees(self) -> list[str]:
        """Lines for a run's summary after its tree's: one tree per range (none for one)."""
        if _alone(self.count) or self.tree is None:
            return []
        return [
            f"the same tree for each server's range: node0s1 ... relay range 1 to ps1, "
            f"and so on ({len(self.tree.nodes) * self.count} tree nodes)"
        ]
