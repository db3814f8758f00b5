"""``data:``: which dataset, how many clients, how it is partitioned, where the files live."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from cluster.config.errors import ConfigError
from cluster.config.paths import configured_path, resolved_path
from datasets.glue import DEFAULT_MAX_LENGTH, GLUE_SOURCES
from datasets.locations import Location, LocationError, parse_location


@dataclass
class SyntheticConfig:
    """DP-SCAFFOLD's synthetic(α, β) benchmark; one natural user per client."""

    alpha: float = 1.0
    beta: float = 1.0
    samples_per_user: int = 5000
    num_features: int = 40
    num_classes: int = 10
    label_noise: float = 0.05
    train_fraction: float = 0.8


@dataclass
class PartitionConfig:
    method: str = "natural"  # natural | iid | dirichlet | dirichlet_class | shards
    alpha: float | None = None  # Dirichlet concentration (dirichlet, dirichlet_class)
    min_size: int | None = None  # dirichlet_class: fewest rows per client (default 10)
    classes_per_client: int | None = None  # shards: k shards per client (default 2)
    # dirichlet: draws per client with class pools refilled (rows repeat; DP-FedPGN's code);
    # label_skew: rows per user
    samples_per_client: int | None = None
    iid_fraction: float | None = None  # label_skew: γ i.i.d., the rest from label u mod K


@dataclass
class ValidationConfig:
    """``data.validation``: data held out of training to select hyperparameters by, evaluated
    like the test set (``datasets.validation``). Exactly one of:

    - ``fraction``: this fraction of every client's training rows (round(f·n) of its n), a
      seeded choice; the client trains on the rest. Private data: the clients' own rows.
    - ``clients``: round(f·num_clients) further clients, partitioned with the
      ``num_clients`` training clients and then held out whole: outside the training
      population (public data for the tuning statement, ``privacy.tuning``).
    - ``folds`` and ``fold``: k-fold cross-validation: every client's training rows in a
      seeded order cut into ``folds`` near-equal parts (the order does not depend on
      ``fold``), part ``fold`` (0-based) held out. Private data.
    """

    fraction: float | None = None
    clients: float | None = None
    folds: int | None = None
    fold: int | None = None

    @property
    def kind(self) -> str:
        """ "rows", "clients" or "folds": what is held out."""
        if self.clients is not None:
            return "clients"
        return "folds" if self.folds is not None else "rows"

    def held_out_clients(self, num_clients: int) -> int:
        """Clients partitioned besides the ``num_clients`` training ones and held out."""
        return 0 if self.clients is None else round(self.clients * num_clients)

    def describe(self) -> dict:
        """The options that are set (they key the validation store)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class DataConfig:
    source: str = "synthetic"
    num_clients: int = 100
    # relative to the working directory, or $DPFL_STORE_ROOT; or s3://bucket/prefix
    store_root: str = "shards"
    store: str | None = None  # an existing store (path or s3:// URI, e.g. from `partition`)
    root: str = "data"  # raw dataset files (torchvision layout), or $DPFL_DATA_ROOT
    download: bool = False  # fetch missing raw files (needs internet)
    split: str | None = None  # emnist: byclass (default) | balanced | letters
    only_digits: bool = False  # femnist: the 10-class digits-only files
    pca_components: int | None = None  # mnist sources: features = top-k PCA of the pixels
    # Also evaluate on per-client test sets of this size in each client's label mix (DP-FedSAM)
    test_per_client: int | None = None
    # A pretrained model folder inside `root` (timm / Hugging Face layout: config.json,
    # model.safetensors or pytorch_model.bin; vocab.json + merges.txt for RoBERTa): the initial
    # weights of vit_b16 / roberta_base tasks, and the tokenizer of the GLUE sources
    pretrained: str | None = None
    max_length: int | None = None  # GLUE sources: token ids per row (default 128)
    # datasets.preparation (vision sources): a seeded fraction of the training split (DP-FedSAM
    # EMNIST: 0.2); per-feature standardisation (all clients' statistics, outside DP) then unit
    # L2 norm per row (DP-SCAFFOLD); this fraction of each client's rows held out as its test
    # rows, the store's test set (DP-SCAFFOLD: 0.2)
    train_subsample_fraction: float | None = None
    standardize_unit_norm: bool = False
    client_test_fraction: float | None = None
    # What pca_components and standardize_unit_norm fit their statistics to: source_test (the
    # source's test split, used for nothing else where client_test_fraction gives the clients
    # their test rows: public data, the default there) or training (all clients' training
    # rows, as DP-SCAFFOLD does: outside the DP mechanism, so the run is dp_valid=false; the
    # default elsewhere). Source synthetic: population (the generator's own mean and variance,
    # the default) or training (all users' rows pooled, the papers' code: dp_valid=false)
    statistics_from: str | None = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    validation: ValidationConfig | None = None  # held-out data for tuning (ValidationConfig)

    @property
    def partitioned_clients(self) -> int:
        """Clients the partition draws: the training ones, and held-out validation clients."""
        held_out = (
            0 if self.validation is None else self.validation.held_out_clients(self.num_clients)
        )
        return self.num_clients + held_out

    def resolved_store_root(self) -> Location:
        """An absolute path (actors do not share the driver's working directory) or an
        object-store prefix."""
        return resolved_path("data.store_root", "DPFL_STORE_ROOT", self.store_root, True)

    def configured_store_root(self) -> Location:
        """``data.store_root`` or ``$DPFL_STORE_ROOT`` as configured (``configured_path``)."""
        return configured_path("data.store_root", "DPFL_STORE_ROOT", self.store_root, True)

    @property
    def store_is_absolute(self) -> bool:
        """Configured as an absolute path or an object-store URI (so not inside a Ray job's
        temporary directory)."""
        return self.configured_store_root().is_absolute()

    def store_location(self) -> Location | None:
        """``data.store`` parsed (None when unset); a malformed URI is a ``ConfigError``."""
        if self.store is None:
            return None
        try:
            return parse_location(self.store)
        except LocationError as error:
            raise ConfigError("data.store", self.store, error.problem) from None

    def resolved_data_root(self) -> Path:
        return resolved_path("data.root", "DPFL_DATA_ROOT", self.root)

    def pretrained_folder(self) -> Path | None:
        """The pretrained folder, inside the data root (``validate_pretrained`` checked it)."""
        return None if self.pretrained is None else self.resolved_data_root() / self.pretrained

    def source_options(self) -> dict:
        """The source's own options and the data preparation's (they key the store)."""
        if self.source == "synthetic":
            options = {**asdict(self.synthetic), "num_users": self.partitioned_clients}
            return {**options, **self.preparation_options()}
        if self.source == "emnist":
            return {"split": self.split or "byclass", **self.preparation_options()}
        if self.source == "femnist":
            return {"only_digits": self.only_digits, **self.preparation_options()}
        if self.source in GLUE_SOURCES:
            length = self.max_length or DEFAULT_MAX_LENGTH
            text = {"tokenizer": self.pretrained, "max_length": length}
            return {**text, **self.preparation_options()}
        options = {} if self.pca_components is None else {"pca_components": self.pca_components}
        return {**options, **self.preparation_options()}

    def preparation_options(self) -> dict:
        """The ``datasets.preparation`` options that are set (unset ones key no store, nor
        does ``statistics_from: training``, what stores were fitted to before the option)."""
        public = self.fits_statistics and self.resolved_statistics_from != "training"
        chosen = {
            "train_subsample_fraction": self.train_subsample_fraction,
            "standardize_unit_norm": self.standardize_unit_norm or None,
            "client_test_fraction": self.client_test_fraction,
            "statistics_from": self.resolved_statistics_from if public else None,
        }
        return {name: value for name, value in chosen.items() if value is not None}

    @property
    def fits_statistics(self) -> bool:
        """A step fits statistics to rows: ``pca_components`` or ``standardize_unit_norm``, or
        the synthetic generator's standardisation."""
        steps = self.pca_components is not None or self.standardize_unit_norm is True
        return steps or self.source == "synthetic"

    @property
    def resolved_statistics_from(self) -> str:
        """``statistics_from``, or its default: ``population`` for the synthetic source (the
        generator's own mean and variance, ``datasets.synthetic``), ``source_test`` where
        ``client_test_fraction`` leaves the source's test split unused, else ``training``."""
        if self.statistics_from is not None:
            return self.statistics_from
        if self.source == "synthetic":
            return "population"
        public = self.client_test_fraction is not None and self.source not in TEST_SHARES_WRITERS
        return "source_test" if public else "training"

    @property
    def statistics_outside_dp(self) -> str | None:
        """Why no ε holds where the preparation's statistics are fitted to the clients'
        training rows, else None."""
        if not self.fits_statistics or self.resolved_statistics_from != "training":
            return None
        if self.source == "synthetic":
            return (
                "data.source synthetic standardises every feature with the mean and std of all "
                "users' rows (data.statistics_from: training, as the papers' code does), outside "
                "the DP mechanism: one record moves every other row's features; standardise "
                "with the generator's own statistics, data.statistics_from: population (the "
                "default)"
            )
        steps = [
            name
            for name, on in (
                ("pca_components", self.pca_components is not None),
                ("standardize_unit_norm", self.standardize_unit_norm is True),
            )
            if on
        ]
        return (
            f"data.{' and data.'.join(steps)} {'fit' if len(steps) > 1 else 'fits'} statistics "
            "to all clients' training rows "
            "(data.statistics_from: training, as DP-SCAFFOLD does), outside the DP mechanism: "
            "one record moves every other row's features; fit them to public data with "
            "data.statistics_from: source_test (with data.client_test_fraction)"
        )


# ----------------------------------------------------------------------------- checks


def validate_validation(v: ValidationConfig, num_clients: int) -> None:
    """One of fraction, clients, folds (with fold), each in range."""
    chosen = [name for name in ("fraction", "clients", "folds") if getattr(v, name) is not None]
    if len(chosen) != 1:
        raise ConfigError(
            "data.validation",
            v.describe(),
            "set exactly one of fraction (of every client's rows, e.g. 0.1), clients (held-out "
            "clients, e.g. 0.1) or folds with fold (cross-validation, e.g. folds: 5, fold: 0)",
        )
    for name in ("fraction", "clients"):
        value = getattr(v, name)
        if value is not None and not 0 < value < 1:
            raise ConfigError(f"data.validation.{name}", value, "must be in (0, 1), e.g. 0.1")
    if v.clients is not None and v.held_out_clients(num_clients) < 1:
        raise ConfigError(
            "data.validation.clients",
            v.clients,
            f"holds out round({v.clients:g}·{num_clients}) = 0 of the {num_clients} clients "
            f"(data.num_clients); raise it to at least {1 / num_clients:.3g}",
        )
    if v.folds is not None and v.folds < 2:
        raise ConfigError("data.validation.folds", v.folds, "must be >= 2, e.g. 5")
    if (v.fold is None) != (v.folds is None):
        raise ConfigError(
            "data.validation.fold",
            v.fold,
            "fold (0-based) goes with folds, e.g. folds: 5, fold: 0; set both or neither",
        )
    if v.folds is not None and not 0 <= v.fold < v.folds:
        raise ConfigError(
            "data.validation.fold", v.fold, f"must be in [0, {v.folds - 1}] (folds: {v.folds})"
        )


def validate_preparation(d: DataConfig) -> None:
    """``datasets.preparation``'s options: vision sources only, fractions in range, and no
    matched per-client test sets drawn from held-out rows."""
    if d.source == "synthetic":
        for name, value in d.preparation_options().items():
            if name == "statistics_from":
                continue
            raise ConfigError(
                f"data.{name}",
                value,
                "not for source synthetic: its generator already standardises, unit-normalises "
                "and splits each user's rows (data.synthetic.train_fraction); remove it",
            )
    if d.train_subsample_fraction is not None and not 0 < d.train_subsample_fraction <= 1:
        raise ConfigError(
            "data.train_subsample_fraction",
            d.train_subsample_fraction,
            "must be in (0, 1] (DP-FedSAM's EMNIST: 0.2), or null for the whole training split",
        )
    if not isinstance(d.standardize_unit_norm, bool):
        raise ConfigError("data.standardize_unit_norm", d.standardize_unit_norm, "true or false")
    _validate_statistics_from(d)
    fraction = d.client_test_fraction
    if fraction is not None and not 0 < fraction < 1:
        raise ConfigError(
            "data.client_test_fraction",
            fraction,
            "must be in (0, 1) (DP-SCAFFOLD: 0.2), or null to evaluate on the source's test split",
        )
    if fraction is not None and d.test_per_client is not None:
        raise ConfigError(
            "data.test_per_client",
            d.test_per_client,
            "data.client_test_fraction already gives every client its own held-out test rows; "
            "remove one of the two",
        )


# Which partition options each method reads.
PARTITION_OPTIONS = {
    "alpha": ("dirichlet", "dirichlet_class"),
    "min_size": ("dirichlet_class",),
    "classes_per_client": ("shards",),
    "samples_per_client": ("dirichlet", "label_skew"),
    "iid_fraction": ("label_skew",),
}


def validate_partition(p: PartitionConfig) -> None:
    """Partition options: each only for the methods that read it, with valid values."""
    for name, methods in PARTITION_OPTIONS.items():
        value = getattr(p, name)
        if value is not None and p.method not in methods:
            raise ConfigError(
                f"data.partition.{name}",
                value,
                f"only used by method: {' or '.join(methods)} (method is {p.method!r}); remove it",
            )
    if p.method in PARTITION_OPTIONS["alpha"] and (p.alpha is None or not p.alpha > 0):
        raise ConfigError(
            "data.partition.alpha", p.alpha, "the Dirichlet concentration α must be > 0 (e.g. 0.3)"
        )
    if p.method == "label_skew" and (p.iid_fraction is None or not 0 <= p.iid_fraction <= 1):
        raise ConfigError(
            "data.partition.iid_fraction",
            p.iid_fraction,
            "label_skew needs the i.i.d. fraction γ in [0, 1] (DP-SCAFFOLD: 0, 0.1 or 1)",
        )
    if p.min_size is not None and p.min_size < 1:
        raise ConfigError(
            "data.partition.min_size",
            p.min_size,
            "must be >= 1: a client without rows cannot train; e.g. 10 (the default)",
        )
    if p.classes_per_client is not None and p.classes_per_client < 1:
        raise ConfigError(
            "data.partition.classes_per_client", p.classes_per_client, "must be >= 1, e.g. 2"
        )
    if p.samples_per_client is not None and p.samples_per_client < 1:
        raise ConfigError(
            "data.partition.samples_per_client",
            p.samples_per_client,
            "must be >= 1 (e.g. 500), or null for an equal split without repeats",
        )


# Sources whose test split comes from the training clients' own writers (datasets/femnist.py):
# never public data for ``statistics_from``.
TEST_SHARES_WRITERS = ("femnist",)


def _validate_statistics_from(d: DataConfig) -> None:
    """``statistics_from``: training or source_test, the latter only where the source's test
    split is no run's test set, and only where a step fits statistics."""
    if d.statistics_from is None:
        return
    if d.source == "synthetic" and d.statistics_from != "training":
        if d.statistics_from != "population":
            raise ConfigError(
                "data.statistics_from",
                d.statistics_from,
                "for source synthetic: population (the generator's own mean and variance, the "
                "default) or training (all users' rows pooled, outside DP: dp_valid=false)",
            )
        return
    if d.statistics_from not in ("training", "source_test"):
        raise ConfigError(
            "data.statistics_from",
            d.statistics_from,
            "training (all clients' rows, outside DP: dp_valid=false) or source_test (the "
            "source's test split, with data.client_test_fraction)",
        )
    if not d.fits_statistics:
        raise ConfigError(
            "data.statistics_from",
            d.statistics_from,
            "only data.pca_components and data.standardize_unit_norm fit statistics; remove it",
        )
    if d.statistics_from == "source_test" and d.source in TEST_SHARES_WRITERS:
        raise ConfigError(
            "data.statistics_from",
            d.statistics_from,
            f"{d.source}'s test split holds the same writers' other examples, so it is the "
            "clients' data, not public data: statistics_from: training (outside DP: "
            "dp_valid=false), or remove the step that fits statistics",
        )
    if d.statistics_from == "source_test" and d.client_test_fraction is None:
        raise ConfigError(
            "data.statistics_from",
            d.statistics_from,
            "the source's test split is this run's test set; set data.client_test_fraction "
            "(each client's own test rows, e.g. 0.2) so that it is public data used for nothing "
            "else, or statistics_from: training (outside DP: dp_valid=false)",
        )
