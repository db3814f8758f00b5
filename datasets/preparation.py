"""The papers' data preparation around partitioning: subsample, standardise, hold out test rows.

Three options, each off unless set, applied by ``datasets.sources.build_store`` in this order
(they key the store like the source's own options, ``PREPARATION_OPTIONS``):

1. ``train_subsample_fraction`` f (DP-FedSAM's EMNIST, "20% used"): a seeded uniform subset of
   round(f·N) of the source's N training rows, drawn without replacement from
   ``SeedSequence([seed, SUBSAMPLE_STREAM])``, kept in their original order; the test split is
   kept whole.
2. ``standardize_unit_norm`` (DP-SCAFFOLD, spec 004 §4: "features are standardised, then each
   point is scaled to unit L2 norm"): after the source's own features (PCA for MNIST, so PCA →
   standardise → normalise), every feature is centred and divided by its standard deviation
   over the training split (a constant feature is only centred), then every row — train and
   test — is divided by its L2 norm. Rows become float32. **Privacy:** the means and
   standard deviations are computed from all clients' rows together, before partitioning, as
   the paper does; this step is outside the DP mechanism and no ε covers it (the unit norm is
   per row and leaks nothing). A per-client variant would not repair it: under DP-SCAFFOLD's
   record-level adjacency one record would still shift its own client's statistics and so every
   other row of that client; only statistics from public data would. So ``statistics_from``
   chooses: ``training`` (the paper's; the run is ``dp_valid=false``,
   ``cluster.config.data.DataConfig.statistics_outside_dp``) or ``source_test``, the source's
   test split, which step 3 leaves unused (the default where step 3 runs). A PCA
   (``datasets.sources.pca_features``) is fitted to the same split.
3. ``client_test_fraction`` f (DP-SCAFFOLD: "80%/20% train/test split" of every user): after
   partitioning, round(f·n_i) (ties to even) of each client's n_i rows, chosen uniformly from
   ``SeedSequence([seed, HOLDOUT_STREAM])``, become that client's test rows. They leave the
   client's training shard (never trained on, not in R_train) and make up the store's whole
   test set, each row owned by its client; the source's own test split is not stored, so the
   run's test accuracy is that over the pooled users' test rows, the paper's metric. Steps 1
   and 2 (and a PCA) are fitted before it, as in the paper, so the held-out rows take part in
   the standardisation statistics: a mild leak from test to training features.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from datasets.arrays import LabeledArrays
from datasets.partition import PartitionError

PREPARATION_OPTIONS = (
    "train_subsample_fraction",
    "standardize_unit_norm",
    "client_test_fraction",
    "statistics_from",
)
SUBSAMPLE_STREAM = 0x5AB5
HOLDOUT_STREAM = 0x7E5C


@dataclass(frozen=True)
class Preparation:
    """Which of the module's steps run; the defaults run none."""

    train_subsample_fraction: float | None = None
    standardize_unit_norm: bool = False
    client_test_fraction: float | None = None
    # or "source_test": what statistics are fitted to ("population": the synthetic generator's)
    statistics_from: str = "training"

    def before_partition(
        self, train: LabeledArrays, test: LabeledArrays, seed: int
    ) -> tuple[LabeledArrays, LabeledArrays]:
        """Steps 1 and 2 on the source's (train, test)."""
        if self.train_subsample_fraction is not None:
            train = subsample_rows(train, self.train_subsample_fraction, seed)
        if self.standardize_unit_norm:
            train, test = standardize_unit_norm(train, test, self.statistics_from)
        return train, test

    def after_partition(
        self, train: LabeledArrays, test: LabeledArrays, clients: list[np.ndarray], seed: int
    ) -> tuple[LabeledArrays, list[np.ndarray]]:
        """Step 3: (test set, clients' training rows); unchanged when it is off."""
        if self.client_test_fraction is None:
            return test, clients
        return hold_out_client_tests(train, clients, self.client_test_fraction, seed)


def split_preparation(options: dict) -> tuple[dict, Preparation]:
    """(the source's own options, the preparation) of a store's source options."""
    own = {k: v for k, v in options.items() if k not in PREPARATION_OPTIONS}
    chosen = {k: options[k] for k in PREPARATION_OPTIONS if k in options}
    return own, Preparation(**chosen)


def subsample_rows(data: LabeledArrays, fraction: float, seed: int) -> LabeledArrays:
    """round(fraction·N) of the N rows, uniformly without replacement, in their order;
    ``PartitionError`` where that is none of them."""
    if not 0 < fraction <= 1:
        raise ValueError(f"train_subsample_fraction must be in (0, 1], got {fraction}")
    count = round(fraction * len(data))
    if count == 0 and len(data):
        raise PartitionError(
            "train_subsample_fraction",
            f"keeps round({fraction:g}·{len(data)}) = 0 of the {len(data)} training rows; "
            f"raise it to at least 1/{len(data)} = {1 / len(data):.3g}",
        )
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), SUBSAMPLE_STREAM]))
    keep = rng.choice(len(data), size=count, replace=False)
    return data.take(np.sort(keep))


def fitted_split(train: LabeledArrays, test: LabeledArrays, statistics_from: str):
    """The split whose rows a preparation step fits its statistics to: ``training`` (all
    clients' rows, as the papers do: outside the DP mechanism) or ``source_test`` (the source's
    test split, public data where the clients hold their own test rows)."""
    if statistics_from not in ("training", "source_test"):
        raise ValueError(f"statistics_from must be training or source_test: {statistics_from!r}")
    return train if statistics_from == "training" else test


def standardize_unit_norm(
    train: LabeledArrays, test: LabeledArrays, statistics_from: str = "training"
) -> tuple[LabeledArrays, LabeledArrays]:
    """Both splits standardised per feature with the statistics of ``fitted_split``, then each
    row scaled to unit L2 norm (an all-zero row stays zero); float32, shapes kept."""
    fitted = fitted_split(train, test, statistics_from)
    features = fitted.x.reshape(len(fitted), -1).astype(np.float64)
    mean = features.mean(axis=0)
    std = features.std(axis=0)
    scale = np.where(std > 0, std, 1.0)

    def transform(split: LabeledArrays) -> LabeledArrays:
        rows = (split.x.reshape(len(split), -1).astype(np.float64) - mean) / scale
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        rows /= np.where(norms > 0, norms, 1.0)
        return LabeledArrays(rows.astype(np.float32).reshape(split.x.shape), split.y, split.group)

    return transform(train), transform(test)


def hold_out_client_tests(
    train: LabeledArrays, clients: list[np.ndarray], fraction: float, seed: int
) -> tuple[LabeledArrays, list[np.ndarray]]:
    """(the held-out test rows, owned by their client, and each client's remaining training
    rows): round(fraction·n_i) of client i's n_i rows, uniformly at random. Raises
    PartitionError when a client would keep no training row, when no client would hold out
    one, or when a held-out row is also
    another client's training row (partitions that repeat rows)."""
    if not 0 < fraction < 1:
        raise ValueError(f"client_test_fraction must be in (0, 1), got {fraction}")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), HOLDOUT_STREAM]))
    kept, held = [], []
    for client, rows in enumerate(clients):
        count = round(fraction * len(rows))
        if count >= len(rows) > 0:
            raise PartitionError(
                "client_test_fraction",
                f"client {client} has {len(rows)} rows and would keep none for training; "
                "lower client_test_fraction or give clients more rows",
            )
        chosen = np.zeros(len(rows), dtype=bool)
        chosen[rng.choice(len(rows), size=count, replace=False)] = True
        kept.append(rows[~chosen])
        held.append(rows[chosen])
    rows = np.concatenate(held) if held else np.empty(0, dtype=np.int64)
    largest = max((len(c) for c in clients), default=0)
    if largest and not len(rows):
        raise PartitionError(
            "client_test_fraction",
            f"holds out round(fraction·n) = 0 rows of every client (the largest has {largest}), "
            f"so the test set would be empty; raise it to at least 1/{largest} = "
            f"{1 / largest:.3g}",
        )
    if len(kept) and np.isin(rows, np.concatenate(kept)).any():
        raise PartitionError(
            "client_test_fraction",
            "the partition gives some rows to several clients, so a row held out for one "
            "client would be trained on by another; use a partition without repeated rows",
        )
    owners = np.repeat(np.arange(len(clients)), [len(h) for h in held])
    test = train.take(rows)
    return LabeledArrays(test.x, test.y, owners.astype(np.int64)), kept
