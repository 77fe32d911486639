"""The paper's published results as data, for side-by-side reports (``rudra-zmq report``).

Gupta, Zhang, Wang, "Model Accuracy and Runtime Tradeoff in Distributed Deep Learning: A
Systematic Study", IJCAI 2017 (arXiv 1509.04210). Table 2: CIFAR-10 (Caffe's
``cifar10_full``), Rudra-base, n-softsync with α = α0/⟨σ⟩, test error after 140 epochs, µ·λ
held about constant in four groups. The paper's times come from a P775 cluster and do not
compare with this machine's; its errors and their orderings do. The text extraction of the
paper is ragged around the first µ·λ ≈ 128 rows: pairing 18.92 % with (σ, µ, λ) = (18, 8, 18)
is the most likely reading. The µ = 128, λ = 1 baseline is not a row of Table 2.
"""

from __future__ import annotations

import math
from typing import NamedTuple

TABLE2_EPOCHS = 140
MU_LAMBDA_GROUPS = (128, 256, 512, 1024)


class Table2Row(NamedTuple):
    mu_lambda: int  # the µ·λ group the paper puts the row in (≈ 128 ... ≈ 1024)
    sigma: int  # σ = n of n-softsync
    mu: int  # µ, minibatch per learner
    lam: int  # λ, learners
    test_error_pct: float  # test error after 140 epochs, %
    train_time_s: int  # training time on the paper's cluster, s


TABLE2 = tuple(
    Table2Row(*row)
    for row in (
        (128, 1, 4, 30, 18.09, 1573),
        (128, 30, 4, 30, 18.41, 2073),
        (128, 18, 8, 18, 18.92, 2488),
        (128, 10, 16, 10, 18.79, 3396),
        (128, 4, 32, 4, 18.82, 7776),
        (128, 2, 64, 2, 17.96, 13449),
        (256, 1, 8, 30, 20.04, 1478),
        (256, 30, 8, 30, 19.65, 1509),
        (256, 18, 16, 18, 20.33, 2938),
        (256, 10, 32, 10, 20.82, 3518),
        (256, 4, 64, 4, 20.70, 6631),
        (256, 2, 128, 2, 19.52, 11797),
        (256, 1, 128, 2, 19.59, 11924),
        (512, 1, 16, 30, 23.25, 1469),
        (512, 30, 16, 30, 22.14, 1502),
        (512, 18, 32, 18, 23.63, 2255),
        (512, 10, 64, 10, 24.08, 2683),
        (512, 4, 128, 4, 23.01, 7089),
        (1024, 1, 32, 30, 27.16, 1299),
        (1024, 30, 32, 30, 27.27, 1420),
        (1024, 18, 64, 18, 28.31, 1713),
        (1024, 1, 128, 10, 29.83, 2551),
        (1024, 10, 128, 10, 29.90, 2626),
    )
)


def mu_lambda_group(mu_lambda) -> int | None:
    """The Table 2 group (128, 256, 512 or 1024) within a factor √2 of ``mu_lambda``, else
    None (µ·λ = 120 is ≈ 128; 32 is in no group)."""
    if not mu_lambda or mu_lambda <= 0:
        return None
    group = min(MU_LAMBDA_GROUPS, key=lambda g: abs(math.log(mu_lambda / g)))
    return group if abs(math.log(mu_lambda / group)) <= math.log(2) / 2 else None


def table2_row(mu, lam, sigma) -> Table2Row | None:
    """The Table 2 row with the same µ·λ group, σ, µ and λ, or None where the paper has none."""
    if mu is None or lam is None:
        return None
    group = mu_lambda_group(mu * lam)
    return next(
        (r for r in TABLE2 if (r.mu_lambda, r.sigma, r.mu, r.lam) == (group, sigma, mu, lam)), None
    )
