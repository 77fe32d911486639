"""The statistics server's evaluator: the model and the test split, loaded once, and the test
error and loss of a set of weights over the whole split.

Loading imports torch and reads (or decodes) the data: seconds, so the server binds first
(``StatsServer``). An evaluation copies the weights into the model's flat buffer and runs the
split in batches of ``EVAL_BATCH``, calling ``between()`` after each (the server drains its
socket there, so a long evaluation never stalls the metrics). Blocks; torch releases the GIL
while it computes. Not thread-safe: the statistics server's thread owns it.
"""

from __future__ import annotations

import numpy as np

from .. import kernels

EVAL_BATCH = 500


class Evaluator:
    """The model of ``cfg`` (``model.name``, ``model.seed``) and the test split of its data
    (``dataset``, an already loaded ``datasets.Dataset``, or ``data_order.load_data``).
    Blocks while it loads. ``flat``: the model's flat buffer (``flat.numel`` floats)."""

    def __init__(self, cfg, dataset=None):
        # torch and the data: imported here, after the server bound, not when it is imported
        from ..data.data_order import load_data
        from ..flat import FlatModel
        from ..models import build_model, input_transform

        ds = dataset if dataset is not None else load_data(cfg)
        self.x_test, self.y_test = ds.x_test, ds.y_test
        self.mean, self.std = tuple(ds.mean), tuple(ds.std)
        self.model = build_model(
            cfg.model.name, cfg.data.num_classes, ds.shape, seed=cfg.model.seed
        )
        self.prep = input_transform(cfg.model.name)
        self.flat = FlatModel(self.model)

    def evaluate(self, weights_parts, between=None, stop_event=None) -> tuple[float, float] | None:
        """Load the weights (one float32 array, or a list of the chunks of an EVAL) and return
        (test error 0..1, mean test loss) over the whole test split, or None if ``stop_event``
        was set meanwhile. ``between()`` is called after every test batch. Raises ValueError
        when the chunks do not add up to the model's size. Blocks."""
        import torch
        import torch.nn.functional as F

        if isinstance(weights_parts, np.ndarray):
            weights_parts = [weights_parts]
        off = 0
        for part in weights_parts:
            n = part.shape[0]
            kernels.copy_into(self.flat.weights[off : off + n], part)
            off += n
        if off != self.flat.numel:
            raise ValueError(f"evaluate got {off:,} floats; the model has {self.flat.numel:,}")
        self.model.eval()
        wrong, loss_sum, total = 0, 0.0, self.y_test.shape[0]
        with torch.no_grad():
            for i in range(0, total, EVAL_BATCH):
                x = self.prep(self.x_test[i : i + EVAL_BATCH], self.mean, self.std)
                y = torch.from_numpy(self.y_test[i : i + EVAL_BATCH])
                out = self.model(x)
                loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
                wrong += int((out.argmax(1) != y).sum())
                if between is not None:
                    between()
                if stop_event is not None and stop_event.is_set():
                    return None  # SIGTERM mid-evaluation: finish promptly instead
        return wrong / max(total, 1), loss_sum / max(total, 1)
