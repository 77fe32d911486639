"""A half wire pushing during backward (``learner/buckets.py`` with ``codec.Half``): each part is
narrowed the moment backward finishes it, with its own slice of the error-feedback residual,
and leaves from inside backward; the bytes each server receives, and the residual kept, are
bit for bit those of narrowing the finished range after backward (K = 1, 2, 4; striped and
ranges; float16 and bfloat16; over steps, so the residual carries). Hardsync on a float16
wire pushing during backward ends with the very weights of pushing after it."""

import numpy as np
import pytest
import torch
from torch import nn

from rudra_zmq import codec
from rudra_zmq.config import load_config
from rudra_zmq.flat import FlatModel
from rudra_zmq.learner.buckets import StreamedPush, enabled, request_calls
from rudra_zmq.learner.carriers import Frames
from rudra_zmq.shape import ClusterShape
from test_buckets import assert_pushing_during_backward_ends_as_after

CHUNK_BYTES = 64  # a part in several frames: 32 halves a frame


def model():
    torch.manual_seed(0)
    return FlatModel(
        nn.Sequential(nn.Linear(37, 29), nn.Tanh(), nn.Linear(29, 23), nn.Linear(23, 7))
    )


def backward(flat, step: int):
    """One step's gradient: a new batch each step, scaled so some values are subnormal or
    round far in half precision."""
    flat.zero_grad()
    x = torch.randn(5, 37, generator=torch.Generator().manual_seed(step))
    (flat.module(x).square().sum() * 10.0 ** (step - 2)).backward()


class Recorder:
    """A channel's sending side that keeps each message's payload bytes as they are when sent
    (``(server, at) -> bytes``), and whether backward was running."""

    def __init__(self, k: int, sent: dict, in_backward: list):
        self.k, self.sent, self.in_backward = k, sent, in_backward

    def parts(self, kind, ts, parts, into, last=None):
        return list(parts)

    def send_part(self, msg):
        at, frames = msg
        assert all(f.nbytes <= CHUNK_BYTES for f in frames)
        self.sent[self.k, at] = (b"".join(f.tobytes() for f in frames), self.in_backward[0])

    def send(self, kind, ts, payloads, **fields):
        self.send_part((0, payloads))


def carriers(servers, code):
    return [
        Frames(s.share.numel, CHUNK_BYTES, wire_codec=codec.Half(code, feedback=True))
        for s in servers
    ]


@pytest.mark.parametrize("code", ["f2", "bf16"])
@pytest.mark.parametrize(
    "k, parts, stripes",
    [(1, 4, "false"), (2, 1, "false"), (2, 3, "false"), (2, 3, "true"), (4, 2, "false"),
     (4, 3, "true")],
)  # fmt: skip
def test_half_parts_narrowed_in_backward_are_the_bits_of_narrowing_the_range_after_it(
    code, k, parts, stripes
):
    flat = model()
    cfg = load_config(
        None,
        ["sync.protocol=hardsync", f"wire.parts={parts}", f"architecture.servers={k}",
         f"wire.stripes={stripes}"],
    )  # fmt: skip
    servers = ClusterShape.of(cfg, flat.numel).servers
    assert (stripes == "true") == (not servers[0].share.contiguous)
    during, after = carriers(servers, code), carriers(servers, code)
    assert enabled(flat, during)
    stream = StreamedPush(flat, servers)
    in_backward = [False]

    def run(step):
        in_backward[0] = True
        backward(flat, step)
        in_backward[0] = False

    for step in range(4):
        sent = {}
        requests = {
            s.index: request_calls(
                Recorder(s.index, sent, in_backward), step, during[s.index], flat.grads, s,
                np.empty(s.share.numel, np.float32),
            )
            for s in servers
        }  # fmt: skip
        stream.push(lambda step=step: run(step), requests)
        want = {}
        for s in servers:  # the path after backward: the range narrowed whole, then cut
            if len(s.parts) > 1:
                pieces = after[s.index].share_parts(flat.grads, s)
            else:
                pieces = [(0, after[s.index].gradient(s.share.gather(flat.grads))[0])]
            for at, frames in pieces:
                want[s.index, at] = b"".join(f.tobytes() for f in frames)
        assert sorted(sent) == sorted(want)
        for key, (got, in_bw) in sent.items():
            assert in_bw, f"part {key} left after backward"
            assert got == want[key], f"step {step}: part {key} differs"
        for d, a in zip(during, after):  # the residuals carried to the next step, too
            assert d.codec.residual.tobytes() == a.codec.residual.tobytes()
            assert np.any(d.codec.residual != 0)
    assert stream.after == 0 and stream.during == 4 * sum(len(s.parts) for s in servers)
    stream.close()


def test_a_part_that_does_not_fit_its_message_is_refused_naming_its_place():
    half = codec.Half("f2", feedback=True)
    with pytest.raises(ValueError, match="a part of 10 floats at 95 does not fit a message of 100"):
        half.parts_later([(95, np.zeros(10, np.float32))], 100, CHUNK_BYTES)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("k, parts, stripes", [(1, 4, "false"), (2, 3, "true"), (4, 2, "false")])
def test_hardsync_on_float16_pushing_during_backward_ends_bit_identical_to_pushing_after(
    ctx, monkeypatch, k, parts, stripes
):
    """σ = 0 and the same float16 bytes: each server sums what narrowing after backward would
    have sent. Every message of every step leaves from inside backward."""
    common = [
        "sync.protocol=hardsync", "train.epochs=0.25", f"wire.parts={parts}",
        f"wire.stripes={stripes}", "wire.gradient_dtype=float16", "wire.weights_dtype=float16",
    ]  # fmt: skip
    assert_pushing_during_backward_ends_as_after(ctx, monkeypatch, k, parts, common)
