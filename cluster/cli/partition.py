"""``python -m cluster partition``: build a shard store from a dataset and report on it.

    python -m cluster partition --dataset cifar10 --root DATA --clients 500 \\
        --method dirichlet --alpha 0.3 --seed 0 --out shards/cifar10-dir0.3

writes the store at ``--out`` (a directory, or an object-store prefix ``s3://bucket/prefix``:
built in a local temporary directory and uploaded, its manifest last) and its partition report
(class-histogram heatmap, client-size histogram, summary JSON) under ``--out/report/``, prints
the summary, and says how a run uses the store (``data.store``). Options, and an object store's
credentials, endpoint, bucket and write access, are checked before any file is read; an
``--out`` that already holds a store (its manifest) is refused, on disk and on S3 alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from datasets import locations
from datasets.locations import Location, LocationError, ObjectLocation
from datasets.partition import PARTITION_METHODS
from datasets.sources import SOURCES, build_store
from datasets.vision import EMNIST_SPLITS, SourceMissingError

if TYPE_CHECKING:  # the config (torch, the presets) is imported when a store is built
    from cluster.config import DataConfig


def add_parser(commands, help_text: str) -> None:
    p = commands.add_parser(
        "partition",
        help=help_text,
        description="Partition a dataset's training split into client shards (Arrow store) "
        "and write a partition report. Use the store in a run with --set data.store=OUT.",
    )
    p.add_argument("--dataset", required=True, choices=SOURCES)
    p.add_argument("--root", default="data", help="raw dataset files (torchvision layout)")
    p.add_argument("--download", action="store_true", help="fetch missing files (internet)")
    p.add_argument("--split", choices=EMNIST_SPLITS, help="emnist split (default byclass)")
    p.add_argument("--only-digits", action="store_true", help="femnist: digits-only files")
    p.add_argument("--clients", type=int, required=True, help="number of clients")
    p.add_argument("--method", required=True, choices=PARTITION_METHODS)
    p.add_argument("--alpha", type=float, help="Dirichlet concentration")
    p.add_argument("--min-size", type=int, help="dirichlet_class: fewest rows per client")
    p.add_argument("--classes-per-client", type=int, help="shards: shards per client")
    p.add_argument(
        "--samples-per-client",
        type=int,
        help="dirichlet: draws per client, class pools refilled (rows may repeat across clients)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="store directory to write, or s3://BUCKET/PREFIX")
    p.set_defaults(handler=run)


def _data_config(args: argparse.Namespace) -> DataConfig:
    """The run's ``data`` section these options stand for."""
    from cluster.config import DataConfig, PartitionConfig

    return DataConfig(
        source=args.dataset,
        num_clients=args.clients,
        root=args.root,
        download=args.download,
        split=args.split,
        only_digits=args.only_digits,
        partition=PartitionConfig(
            args.method, args.alpha, args.min_size, args.classes_per_client, args.samples_per_client
        ),
    )


def _out_location(out: str) -> Location:
    """``--out`` parsed, holding no store yet (``_refuse_existing_store``), and writable (an
    object store: reachable, a probe object written and deleted); else a ``ConfigError``."""
    from cluster.config import ConfigError
    from cluster.runtime.storage_checks import check_object_store, check_writable_location

    try:
        location = locations.parse_location(out)
    except LocationError as error:
        raise ConfigError("--out", out, error.problem) from None
    check_object_store("--out", location)
    _refuse_existing_store(out, location)
    _refuse_other_files(out, location)
    check_writable_location("--out", location)
    return location


def _refuse_existing_store(out: str, location: Location) -> None:
    """A ``ConfigError`` when a store was committed at ``location`` (its manifest is there):
    runs may be reading it, and a store rewritten under them (in place on S3; on disk, one a
    restarted actor opens anew) hands their clients other rows. Building one elsewhere, or
    deleting this one first, is the user's decision."""
    from cluster.config import ConfigError
    from datasets.store import MANIFEST

    manifest = location / MANIFEST
    try:
        found = locations.exists(manifest)
    except OSError as error:
        raise ConfigError("--out", out, f"unusable ({str(error).splitlines()[0]})") from None
    if not found:
        return
    remove = (
        f"`aws s3 rm --recursive {shlex.quote(f'{location}/')}`"
        if isinstance(location, ObjectLocation)
        else f"`rm -r {shlex.quote(str(location))}`"
    )
    raise ConfigError(
        "--out",
        out,
        f"a shard store is already there ({manifest}), which runs may be reading: rewriting it "
        "would hand their clients other rows; give another --out, or, when no run uses it, "
        f"delete it first ({remove})",
    )


def _refuse_other_files(out: str, location: Location) -> None:
    """A ``ConfigError`` when ``--out`` is a file, or a folder that holds anything (a store is
    written only into a new or empty folder: nothing of the user's is ever replaced)."""
    from cluster.config import ConfigError

    try:
        entries = locations.first_entries(location)
    except OSError as error:
        raise ConfigError("--out", out, f"unusable ({str(error).splitlines()[0]})") from None
    if entries:
        shown = ", ".join(entries) + (", ..." if len(entries) == 3 else "")
        raise ConfigError(
            "--out",
            out,
            f"holds other files ({shown}), and a store is written only into a new or empty "
            "folder; give another --out, e.g. a new subfolder of it",
        )


def _write_report(counts, out: Location) -> list[str]:
    """The partition report under ``out/report`` (``write_partition_report``); its files'
    locations."""
    from datasets.partition_report import write_partition_report

    report = out / "report"
    names: list[str] = []
    locations.write_folder(
        report, lambda folder: names.extend(p.name for p in write_partition_report(counts, folder))
    )
    return [str(report / name) for name in names]


def run(args: argparse.Namespace) -> int:
    from cluster.config import ConfigError, ExperimentConfig, validate_data
    from datasets.partition_report import format_summary, partition_summary

    data = _data_config(args)
    try:
        if args.clients < 1:
            raise ConfigError("--clients", args.clients, "must be >= 1")
        validate_data(ExperimentConfig(data=data))
        out = _out_location(args.out)
        start = time.perf_counter()
        store = build_store(
            out,
            args.dataset,
            data.source_options(),
            dataclasses.asdict(data.partition),
            args.clients,
            args.seed,
            data_root=Path(args.root).expanduser().resolve(),
            download=args.download,
        )
    except (ConfigError, SourceMissingError, ValueError) as error:
        print(f"partition: {error}", file=sys.stderr)
        return 2
    counts = store.class_counts()
    paths = _write_report(counts, out)
    print(f"wrote {store.num_clients} clients to {args.out} in {time.perf_counter() - start:.1f} s")
    print(format_summary(partition_summary(counts, counts.shape[1])))
    print(f"report: {', '.join(paths)}")
    print(f"use it with: {_store_settings(args.out, data, store.num_clients)}")
    print(f"  on {_configs_for(data.source)}")
    return 0


def _configs_for(source: str) -> str:
    """Which configs a store of ``source`` goes with: of that source (another source's options,
    e.g. the quickstart's ``data.synthetic``, are refused for it), with a task reading it."""
    from actors.code_digest import PROJECT_ROOT
    from datasets.tasks import TASKS

    tasks = ", ".join(name for name, task in TASKS.items() if source in task.sources)
    examples = sorted(
        path.relative_to(PROJECT_ROOT).as_posix()
        for path in (PROJECT_ROOT / "configs").rglob("*.yaml")
        if _run_config_source(path) == source
    )
    example = f", e.g. {examples[0]}" if examples else ""
    return f"a config of data.source {source} (task {tasks}{example})"


def _run_config_source(path) -> str | None:
    """The ``data.source`` of a run config (not a sweep's or a comparison's spec)."""
    import yaml

    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return None
    if not isinstance(config, dict) or "task" not in config:
        return None
    data = config.get("data")
    return data.get("source") if isinstance(data, dict) else None


def _store_settings(out: str, data: DataConfig, num_clients: int) -> str:
    """The ``--set`` options a run needs to read the store at ``out`` that ``data`` built: its
    location, source and clients, its partition and the source's options set away from their
    defaults (a run's config must match the store's, ``check_store_options``)."""
    from cluster.config import DataConfig
    from cluster.config.loading import override_text

    partition = {k: v for k, v in dataclasses.asdict(data.partition).items() if v is not None}
    default = DataConfig(source=data.source)
    options = [
        f"--set data.{name}={override_text(getattr(data, name))}"
        for name in ("split", "only_digits")
        if getattr(data, name) != getattr(default, name)
    ]
    return " ".join(
        [
            f"--set {shlex.quote(f'data.store={out}')} --set data.source={data.source}",
            f"--set data.num_clients={num_clients}",
            f"--set 'data.partition={override_text(partition)}'",
            *options,
        ]
    )
