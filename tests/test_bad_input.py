"""The bad-input catalogue: every malformed input a user can give `run` or `resume`.

Each case must end with exit code 2 and one paragraph on stderr naming the file or field, the
value and the fix: no traceback, no Ray started, nothing written (the working directory, the
store root and the MLflow location are byte-for-byte as before). The cases run in process
through ``cluster.cli.main.main`` (the same code path as ``python -m cluster``); one runs as a real
subprocess to check the exit code and stderr of the real command.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import ray
import torch
import yaml

from algorithms.layout import ParamLayout
from cluster.claims.privacy_plan import privacy_claim
from cluster.cli.main import main
from cluster.config import config_from_dict
from cluster.runtime.checkpoint import FORMAT_VERSION, checkpoint_path, save_checkpoint
from cluster.runtime.initial_state import initial_model, initial_state
from cluster.runtime.records import RoundRecord
from datasets.sources import build_store, source_shape, store_path

BASE = {
    "task": "synthetic_logreg",
    "rounds": 2,
    "data": {
        "source": "synthetic",
        "num_clients": 10,
        "synthetic": {"samples_per_user": 20},
        "partition": {"method": "natural"},
    },
    "algorithm": {
        "name": "dp_fedavg",
        "local": {"lr": 0.1, "batch_size": 8, "local_steps": 1},
        "clip_norm": 1.0,
        "noise_multiplier": 1.0,
    },
    "cohort": {"size": 5, "sampling": "fixed"},
    "executor": {"kind": "ray", "num_actors": 2, "cpus_per_actor": 0.5},
}


# No AWS credentials from any source, and an endpoint where nothing listens: no test contacts
# any host but 127.0.0.1.
S3_NO_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "",
    "AWS_SECRET_ACCESS_KEY": "",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
    "AWS_CONFIG_FILE": "/nonexistent/config",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_ENDPOINT_URL": "http://127.0.0.1:1",
}
S3_DOWN = {**S3_NO_CREDENTIALS, "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
S3_ROOT = "data.store_root=s3://dpfl/shards"
SECRET = "S3CRET"  # in a URI's credentials: never on the terminal
PARTITION = ["partition", "--dataset", "synthetic", "--clients", "10", "--method", "natural"]


def partition_into_store(workdir: Path, valid_store: Path, name: str = "out") -> list[str]:
    """``partition --out`` a directory that holds a store already (runs may be reading it)."""
    shutil.copytree(valid_store, workdir / name)
    return [*PARTITION, "--out", str(workdir / name)]


def partition_into_other_files(workdir: Path, valid_store: Path) -> list[str]:
    """``partition --out`` a folder of the user's, not a store: nothing in it may be lost."""
    (workdir / "mine" / "notes").mkdir(parents=True)
    (workdir / "mine" / "thesis.txt").write_text("years of work")
    (workdir / "mine" / "notes" / "a.txt").write_text("more")
    return [*PARTITION, "--out", str(workdir / "mine")]


def partition_onto_a_file(workdir: Path, valid_store: Path) -> list[str]:
    (workdir / "shards.txt").write_text("a file of the user's")
    return [*PARTITION, "--out", str(workdir / "shards.txt")]


def _store_args() -> tuple:
    """``build_store``/``store_path`` arguments of BASE's store, after the root."""
    return config_from_dict(BASE).store_parameters


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Case:
    """``prepare(workdir, valid_store) -> argv`` sets up the files; ``expect``: substrings of
    stderr; ``env``: variables to set, where ``M`` is the MLflow URI (``http``: a port where
    nothing listens)."""

    name: str
    prepare: Callable[[Path, Path], list[str]]
    expect: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


def config_file(workdir: Path, changes: dict | None = None, text: str | bytes | None = None):
    path = workdir / "config.yaml"
    if text is not None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    else:
        raw = json.loads(json.dumps(BASE))
        for dotted, value in (changes or {}).items():
            node = raw
            *parents, last = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        path.write_text(yaml.safe_dump(raw))
    return path


def run_with(changes: dict | None = None, *extra: str, text=None):
    def prepare(workdir: Path, _store: Path) -> list[str]:
        return ["run", str(config_file(workdir, changes, text)), *extra]

    return prepare


def with_store(damage: Callable[[Path], None], changes: dict | None = None, as_built=False):
    """A valid store copied into the work dir, damaged, then named by data.store (or placed
    where the config's own store would be built, ``as_built``)."""

    def prepare(workdir: Path, valid_store: Path) -> list[str]:
        built = store_path(workdir / "shards", *_store_args())
        target = built if as_built else workdir / "store"
        shutil.copytree(valid_store, target)
        damage(target)
        settings = {} if as_built else {"data.store": str(target)}
        return ["run", str(config_file(workdir, {**settings, **(changes or {})}))]

    return prepare


def truncate(name: str) -> Callable[[Path], None]:
    def damage(store: Path) -> None:
        path = store / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return damage


def rewrite_manifest(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(store: Path) -> None:
        manifest = json.loads((store / "manifest.json").read_text())
        change(manifest)
        (store / "manifest.json").write_text(json.dumps(manifest))

    return damage


def wrong_schema(store: Path) -> None:
    table = pa.table({"a": pa.array([1, 2]), "b": pa.array([3, 4])})
    with (
        pa.OSFile(str(store / "test.arrow"), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table)


def resume_with(write: Callable[[Path], None] | bytes, *extra: str, command="resume"):
    """A checkpoint file in the work dir written by ``write`` (bytes: raw file content), given
    to ``command``."""

    def prepare(workdir: Path, _store: Path) -> list[str]:
        path = workdir / "old.pt"
        if isinstance(write, bytes):
            path.write_bytes(write)
        else:
            write(path)
        return [command, str(path), *extra]

    return prepare


def pickled(content: Callable[[], object]) -> Callable[[Path], None]:
    """Writes ``content()`` with a bare torch.save (not through save_checkpoint)."""
    return lambda path: torch.save(content(), path)


def simulation_state(config, rounds: int = 0) -> dict:
    """The state a Simulation of ``config`` could checkpoint after ``rounds`` rounds: its
    initial model and server state, the accountant charged, no client state."""
    model, params = initial_model(config, *source_shape(*config.store_parameters[:2]))
    _, server = initial_state(config, ParamLayout.of(model), params)
    claim = privacy_claim(config, config.build_algorithm())
    accountant = claim.new_accountant()
    for round_index in range(rounds):
        claim.charge(accountant, round_index)
    return {
        "rounds_done": rounds,
        "params": params,
        "extras": server.extras,
        "accountant": accountant.state_dict(),
        "history": [asdict(RoundRecord(r + 1, 0.1, config.cohort.size)) for r in range(rounds)],
        "client_states": {"client_ids": np.zeros(0, dtype=np.int64)},
    }


def checkpoint_payload(config_change=None, state_change=None, rounds=0, changes=()):
    """Writes a checkpoint of BASE (with ``changes``) after ``rounds`` rounds through
    save_checkpoint, its config (a dict) edited by ``config_change`` and its state by
    ``state_change``."""

    def write(path: Path) -> None:
        config = config_from_dict(BASE, list(changes))
        state, raw = simulation_state(config, rounds), config.to_dict()
        for change, target in ((config_change, raw), (state_change, state)):
            if change is not None:
                change(target)
        save_checkpoint(path, state, raw, None)

    return write


class CreatesFile:
    """Unpickled by a loader that runs code, it creates ``target``."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return Path.touch, (self.target,)


def code_payload(target: Path) -> Callable[[], dict]:
    """A checkpoint-shaped payload whose unpickling would create ``target``."""
    return lambda: {"format_version": FORMAT_VERSION, "config": CreatesFile(target)}


def untracked_overwrite(write: Callable[[Path, Path], None]):
    """A run of BASE (tracking off) whose checkpoint path holds the file ``write(path,
    workdir)`` writes."""

    def prepare(workdir: Path, _store: Path) -> list[str]:
        config = config_file(workdir, {"tracking.enabled": False})
        write(checkpoint_path(config_from_dict(BASE, ["tracking.enabled=false"]), None), workdir)
        return ["run", str(config)]

    return prepare


def another_runs_checkpoint(path: Path, _workdir: Path) -> None:
    other = config_from_dict(BASE, ["seed=0", "rounds=50"])
    save_checkpoint(path, simulation_state(other), other.to_dict(), None)


def code_in_checkpoint(path: Path, workdir: Path) -> None:
    path.parent.mkdir(parents=True)
    torch.save(code_payload(workdir / "created")(), path)


def format_1_payload() -> dict:
    """What format 1 wrote: NumPy arrays for the client states."""
    return {"format_version": 1, "simulation": {"client_states": {"client_ids": np.zeros(0)}}}


def a_file(name: str, changes_for: Callable[[Path], dict]):
    def prepare(workdir: Path, _store: Path) -> list[str]:
        (workdir / name).write_text("not a directory")
        return ["run", str(config_file(workdir, changes_for(workdir / name)))]

    return prepare


def empty_dataset_root(workdir: Path, _store: Path) -> list[str]:
    (workdir / "data").mkdir()
    changes = {**MNIST, "data.root": str(workdir / "data")}
    return ["run", str(config_file(workdir, changes))]


def run_file(path: str):
    """``run`` of a file the harness does not write (a device, say)."""
    return lambda _workdir, _store: ["run", path]


def a_fifo(workdir: Path, _store: Path) -> list[str]:
    """A FIFO as the config: reading it would block until a writer came."""
    os.mkfifo(workdir / "config.yaml")
    return ["run", str(workdir / "config.yaml")]


def a_symlink(target: str, field: str):
    """``field`` names a directory below a symlink in the work dir that points at ``target``."""

    def prepare(workdir: Path, _store: Path) -> list[str]:
        (workdir / "link").symlink_to(target)
        return ["run", str(config_file(workdir, {field: str(workdir / "link" / "dpfl")}))]

    return prepare


def spec_with_base(command: str, base: str):
    """``command`` (sweep or compare) of a spec in ``specs/`` whose ``base:`` is ``base``
    (``link.yaml``: a symlink there to /etc/passwd)."""

    def prepare(workdir: Path, _store: Path) -> list[str]:
        specs = workdir / "specs"
        specs.mkdir()
        (specs / "link.yaml").symlink_to("/etc/passwd")
        rest = {"space": {"seed": [1]}} if command == "sweep" else {"runs": {"a": {}}}
        (specs / "spec.yaml").write_text(yaml.safe_dump({"base": base, **rest}))
        return [command, str(specs / "spec.yaml")]

    return prepare


INF, NAN = float("inf"), float("nan")
SKETCHED = {"algorithm.name": "dpsfl", "algorithm.local.lr": 1.0}
MNIST = {"task": "mnist_cnn", "data.source": "mnist", "data.synthetic": {}}  # BASE's: defaults
MNIST_PCA = {**MNIST, "task": "mnist_pca_mlp"}
FEDAVG = {
    "algorithm.name": "fedavg",
    "algorithm.clip_norm": None,
    "algorithm.noise_multiplier": None,
}
DRAWS = {"method": "dirichlet", "alpha": 0.5}  # + samples_per_client
FINITE = ("finite number", ".nan is never accepted")
ONE_FILE_NAME = "it names files, so it must be one file name"
NOT_RAY = ("not a Ray address", "HOST:PORT", "ray://HOST:PORT", "auto")
PSEUDO = ("kernel pseudo-filesystem", "choose a directory on a disk")


UNKNOWN_KEY_IN_CHECKPOINT = checkpoint_payload(
    config_change=lambda c: c["algorithm"].update(retired_option=1)
)
FORMAT_0 = pickled(lambda: {"format_version": 0, "config": config_from_dict(BASE).to_dict()})
# Format 2: this format's fields, from code that seeded CPU streams otherwise (32 bits).
FORMAT_2 = pickled(lambda: {"format_version": 2, "config": config_from_dict(BASE).to_dict()})
FORMAT_3 = pickled(lambda: {"format_version": 3, "config": config_from_dict(BASE).to_dict()})
IN_WORKDIR = Path("created")  # code_payload's target, relative to the case's work dir (its cwd)

CASES = [
    # --- the config file and --set
    Case("config missing", lambda w, s: ["run", str(w / "nope.yaml")], ("CONFIG", "no such")),
    Case("yaml syntax", run_with(text="rounds: [1, 2\ntask: x\n"), ("not valid YAML", "line")),
    Case("yaml list", run_with(text="- rounds\n- 3\n"), ("CONFIG", "YAML mapping")),
    Case("binary file", run_with(text=b"\xff\xfe\x00\x81"), ("CONFIG", "unreadable")),
    Case("unknown key", run_with({"round": 3}), ("round", "did you mean 'rounds'")),
    Case("unknown nested", run_with({"algorithm.local.lrr": 1}), ("algorithm.local.lrr",)),
    Case("section scalar", run_with(text="algorithm: 3\n"), ("algorithm = 3", "mapping")),
    Case("wrong type", run_with({"rounds": "ten"}), ("rounds = 'ten'", "integer")),
    Case("bad literal", run_with({"cohort.sampling": "often"}), ("cohort.sampling", "one of")),
    Case("unknown preset", run_with({"algorithm.name": "dp_fedav"}), ("did you mean",)),
    Case("unknown task", run_with({"task": "mnist_cnnn"}), ("task", "mnist_cnn")),
    Case("source for task", run_with({"data.source": "mnist"}), ("data.source", "reads")),
    Case("negative clip", run_with({"algorithm.clip_norm": -1}), ("algorithm.clip_norm", "> 0")),
    Case(
        "clip below float32's norms",
        run_with({"algorithm.clip_norm": 1e-30}),
        ("algorithm.clip_norm = 1e-30", "at least 1e-06", "underflow"),
    ),
    Case("negative σ", run_with({"algorithm.noise_multiplier": -0.5}), ("noise_multiplier",)),
    Case("cohort > clients", run_with({"cohort.size": 50}), ("cohort.size", "population")),
    Case("δ out of range", run_with({"privacy.delta": 2}), ("privacy.delta", "(0, 1)")),
    Case("calibrate no ε", run_with({"privacy.calibrate": "sigma"}), ("target_epsilon",)),
    Case(
        "secret streams and a stream seed",
        run_with({"privacy.secret_streams": True, "stream_seed": 3}),
        ("stream_seed = 3", "privacy.secret_streams draws", "stream_seed: null"),
    ),
    Case("gpu fraction", run_with({"executor.gpus_per_actor": 1.5}), ("gpus_per_actor",)),
    Case("actors > clients", run_with({"executor.num_actors": 11}), ("num_actors",)),
    Case("set no =", run_with(None, "--set", "rounds"), ("--set", "key.path=value")),
    Case("set into scalar", run_with(None, "--set", "rounds.x=1"), ("not a section",)),
    Case("set bad yaml", run_with(None, "--set", "rounds=[1"), ("--set", "not valid YAML")),
    # --- what the config file holds
    *(
        Case(f"top level {name}", run_with(text=text), ("CONFIG", "must hold a YAML mapping", held))
        for name, text, held in [
            ("empty", "", "holds nothing"),
            ("0", "0\n", "holds a number"),
            ("false", "false\n", "holds true or false"),
            ("[]", "[]\n", "holds a list"),
            ("~", "~\n", "holds nothing"),
            ("string", "quickstart\n", "holds a string"),
            ("comments", "# rounds: 3\n", "holds nothing"),
        ]
    ),
    Case(
        "duplicate key",
        run_with(text="rounds: 2\ntask: synthetic_logreg\nrounds: 3\n"),
        ("CONFIG", "line 3, column 1: duplicate key 'rounds'", "also on line 1", "keep one"),
    ),
    Case(
        "duplicate nested key",
        run_with(text="algorithm:\n  name: dp_fedavg\n  clip_norm: 1.0\n  clip_norm: 2.0\n"),
        ("line 4, column 3: duplicate key 'clip_norm'", "also on line 3"),
    ),
    Case(
        "duplicate key in --set",
        run_with(None, "--set", "algorithm={name: fedavg, name: scaffold}"),
        ("--set", "duplicate key 'name'", "keep one"),
    ),
    Case("config a directory", lambda w, s: ["run", str(w)], ("CONFIG", "is a directory")),
    Case("config /dev/null", run_file("/dev/null"), ("CONFIG", "not a regular file")),
    Case("config /dev/zero", run_file("/dev/zero"), ("CONFIG", "not a regular file")),
    Case("config a FIFO", a_fifo, ("CONFIG", "not a regular file", "pass a YAML config file")),
    Case("config of 1 MB", run_with(text="#" * (1 << 20) + "\n"), ("CONFIG", "larger than 1 MB")),
    Case("yaml nesting", run_with(text="x: " + "[" * 1000), ("not valid YAML", "too deeply")),
    Case("yaml 5000 digits", run_with(text="rounds: " + "9" * 5000), ("CONFIG", "4300 digits")),
    # --- numbers: non-finite, out of range
    Case(
        "σ .inf", run_with({"algorithm.noise_multiplier": INF}), ("noise_multiplier = inf", *FINITE)
    ),
    Case(
        "σ .nan", run_with({"algorithm.noise_multiplier": NAN}), ("noise_multiplier = nan", *FINITE)
    ),
    Case("lr .inf", run_with({"algorithm.local.lr": INF}), ("algorithm.local.lr = inf", *FINITE)),
    Case(
        "lr 1e39",
        run_with({"algorithm.local.lr": 1e39}),
        ("local.lr = 1e+39", "magnitude in [1.2e-38, 3.4e+38]"),
    ),
    Case("lr 'inf'", run_with({"algorithm.local.lr": "inf"}), ("local.lr = 'inf'", *FINITE)),
    Case(
        "α .nan", run_with({"data.synthetic.alpha": NAN}), ("data.synthetic.alpha = nan", *FINITE)
    ),
    Case(
        "Dirichlet α .inf",
        run_with({"data.partition.method": "dirichlet", "data.partition.alpha": INF}),
        ("data.partition.alpha = inf", *FINITE),
    ),
    Case("ε .inf", run_with({"privacy.target_epsilon": INF}), ("target_epsilon = inf", *FINITE)),
    Case("δ .nan", run_with({"privacy.delta": NAN}), ("privacy.delta = nan", *FINITE)),
    Case(
        "cpus .inf", run_with({"executor.cpus_per_actor": INF}), ("cpus_per_actor = inf", *FINITE)
    ),
    Case(
        "clip -.inf", run_with({"algorithm.clip_norm": -INF}), ("clip_norm = -inf", ".inf (no clip")
    ),
    Case("clip .nan", run_with({"algorithm.clip_norm": NAN}), ("clip_norm = nan", "or .inf (no")),
    Case(
        "clip .inf with noise",
        run_with({"algorithm.clip_norm": INF}),
        ("algorithm.clip_norm = inf", "noise needs a finite clip norm"),
    ),
    Case(
        "clip 10**400", run_with({"algorithm.clip_norm": 10**400}), ("algorithm.clip_norm", *FINITE)
    ),
    Case("seed -1", run_with({"seed": -1}), ("seed = -1", "a seed must be in [0, 2**63)")),
    Case("seed 2**63", run_with({"seed": 2**63}), ("seed = 9223372036854775808", "below 2**63")),
    Case(
        "sketch seed -1",
        run_with({**SKETCHED, "algorithm.sketch_seed": -1}),
        ("algorithm.sketch_seed = -1", "[0, 2**63)"),
    ),
    Case("rounds 2**64", run_with({"rounds": 2**64}), ("rounds", "magnitude below 2**63")),
    Case(
        "keep warm on an embedded Ray",
        run_with({"executor.keep_warm_s": 600}),
        ("executor.keep_warm_s = 600", "an embedded Ray ends with this run"),
    ),
    Case(
        "keep warm on a local address",
        run_with({"executor.address": "local", "executor.keep_warm_s": 600}),
        ("executor.keep_warm_s = 600", "an embedded Ray ends with this run"),
    ),
    Case(
        "an embedded Ray inside a Ray job",
        lambda workdir, _store: [
            "run",
            str(
                config_file(
                    workdir, {"executor.address": "local", "checkpoint.dir": str(workdir / "ck")}
                )
            ),
        ],
        ("executor.address = 'local'", "inside a Ray job a second, embedded Ray"),
        env={"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"working_dir": "."}})},
    ),
    Case(
        "a resume onto an embedded Ray inside a Ray job",  # a resume runs the preflight too
        lambda workdir, store: resume_with(
            checkpoint_payload(rounds=1, changes=[f"checkpoint.dir={workdir / 'ck'}"]),
            *("--set", "executor.address=local"),
        )(workdir, store),
        ("executor.address = 'local'", "inside a Ray job a second, embedded Ray"),
        env={"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"working_dir": "."}})},
    ),
    Case(
        "gpus -1",
        run_with({"executor.gpus_per_actor": -1}),
        ("executor.gpus_per_actor = -1", "must be 0, a fraction in [0.0001, 1] or a whole"),
    ),
    Case(
        "overlap start on the local executor",
        run_with({"executor.kind": "local", "executor.overlap_start": True}),
        ("executor.overlap_start = True", "the local executor's hosts are in this process"),
    ),
    Case(
        "overlap start on a remote Ray",
        run_with({"executor.address": "10.0.0.5:6379", "executor.overlap_start": True}),
        ("executor.overlap_start = True", "a running Ray's actors"),
    ),
    Case(
        "overlap start with GPU actors",
        run_with({"executor.gpus_per_actor": 0.5, "executor.overlap_start": True}),
        ("executor.overlap_start = True", "would hold a CUDA context"),
    ),
    Case(
        "overlap start maybe",
        run_with({"executor.overlap_start": "maybe"}),
        ("executor.overlap_start = 'maybe'", "must be one of 'auto', True, False"),
    ),
    Case(
        "keep warm 0.5 s",
        run_with({"executor.keep_warm_s": 0.5}),
        ("executor.keep_warm_s = 0.5", "0 (none) or in [1, 86400]"),
    ),
    Case(
        "cpus too fine",
        run_with({"executor.cpus_per_actor": 1e-5}),
        ("executor.cpus_per_actor = 1e-05", "[0.0001, 1024]"),
    ),
    Case(
        "cpus 1e6", run_with({"executor.cpus_per_actor": 1e6}), ("cpus_per_actor", "[0.0001, 1024]")
    ),
    Case(
        "gpus too fine",
        run_with({"executor.gpus_per_actor": 1e-5}),
        ("executor.gpus_per_actor", "a fraction in [0.0001, 1]"),
    ),
    Case("vectorize 1", run_with({"executor.vectorize": 1}), ("executor.vectorize = 1", "one of")),
    Case(
        "channels_last 1",
        run_with({"executor.channels_last": 1}),
        ("executor.channels_last = 1", "one of 'auto', True, False"),
    ),
    Case(
        "precision fp16",
        run_with({"executor.precision": "fp16"}),
        ("executor.precision = 'fp16'", "one of 'float32', 'bf16'"),
    ),
    Case(
        "bf16 DP-SGD",
        run_with(
            {
                "algorithm.name": "dp_fedavg_sample",
                "algorithm.noise_placement": None,
                "executor.precision": "bf16",
            }
        ),
        ("executor.precision = 'bf16'", "bf16 DP-SGD is not validated", "precision=float32"),
    ),
    Case(
        "placement diagonal",
        run_with({"executor.placement": "diagonal"}),
        ("executor.placement = 'diagonal'", "one of 'pack', 'spread'"),
    ),
    Case(
        "placement spread on the local executor",
        run_with({"executor.kind": "local", "executor.placement": "spread"}),
        ("executor.placement = 'spread'", "set executor.kind=ray"),
    ),
    Case(
        "train rows 0",
        run_with({"data.synthetic.train_fraction": 0.01}),
        ("data.synthetic.train_fraction = 0.01", "at least one training and one test row"),
    ),
    Case(
        "synthetic too big",
        run_with({"data.synthetic.samples_per_user": 10**9}),
        ("data.synthetic = ", "GiB, this machine has", "lower data.num_clients"),
    ),
    Case(
        "sketch too big",
        run_with({**SKETCHED, "algorithm.sketch_rows": 5, "algorithm.sketch_cols": 2**30}),
        ("algorithm.sketch_cols", "counters is over 2147483647"),
    ),
    Case(
        "paper ε 1e-16",
        run_with(
            {
                **SKETCHED,
                "algorithm.sketch_noise": "paper",
                "algorithm.noise_multiplier": None,
                "algorithm.paper_epsilon": 1e-16,
            }
        ),
        ("algorithm.paper_epsilon = 1e-16", "> 1e-15"),
    ),
    Case(
        "η_C 100",
        run_with({**SKETCHED, "algorithm.name": "dpsfl_ac", "algorithm.clip_lr": 100}),
        ("algorithm.clip_lr = 100.0", "must be in (0, 10]"),
    ),
    # --- names that become file names
    *(
        Case(f"{field} {name}", run_with({field: value}), (f"{field} = ", problem, ONE_FILE_NAME))
        for field, name, value, problem in [
            ("tracking.experiment", "../../../x", "../../../x", "contains a path separator"),
            ("tracking.experiment", "..", "..", "is a relative directory"),
            ("tracking.experiment", "backslash", "a\\b", "contains a path separator"),
            ("tracking.experiment", "empty", "", "is empty"),
            ("tracking.experiment", "newline", "a\nb", "non-printable character"),
            ("tracking.experiment", "RTL override", "a\u202eb", "non-printable character"),
            ("tracking.experiment", "101 chars", "x" * 101, "longer than 100 bytes"),
            ("tracking.experiment", "102 bytes", "é" * 51, "longer than 100 bytes"),
            ("tracking.run_name", "a/b", "a/b", "contains a path separator"),
            ("tracking.run_name", ".", ".", "is a relative directory"),
        ]
    ),
    Case(
        "experiment with NUL",
        run_with({"tracking.experiment": "a\0b"}),
        ("tracking.experiment = 'a\\x00b'", "without NUL"),
    ),
    Case(
        "experiment a surrogate",
        run_with(text='tracking:\n  experiment: "\\ud800"\n'),
        ("tracking.experiment", "UTF-8 text"),
    ),
    # --- Ray addresses
    *(
        Case(
            f"address {value!r}", run_with(None, "--address", value), ("executor.address", *NOT_RAY)
        )
        for value in ["ray://h:abc", "127.0.0.1:99999", ":6379", "http://h:8265"]
    ),
    Case("address empty", run_with({"executor.address": ""}), ("executor.address = ''", *NOT_RAY)),
    Case(
        "address [::zz]", run_with({"executor.address": "[::zz]:1"}), ("executor.address", *NOT_RAY)
    ),
    Case(
        "RAY_ADDRESS bad port",
        run_with(),
        ("RAY_ADDRESS = '127.0.0.1:99999'", *NOT_RAY),
        {"RAY_ADDRESS": "127.0.0.1:99999"},
    ),
    Case(
        "RAY_ADDRESS ray://h:abc",
        run_with(),
        ("RAY_ADDRESS", *NOT_RAY),
        {"RAY_ADDRESS": "ray://h:abc"},
    ),
    # --- directories: pseudo-filesystems, unusable paths
    *(
        Case(f"{field} {path}", run_with({**extra, field: path}), (f"{field} = '{path}'", *PSEUDO))
        for field, path, extra in [
            ("checkpoint.dir", "/proc/dpfl", {}),
            ("checkpoint.dir", "/sys/kernel/dpfl", {}),
            ("checkpoint.dir", "/dev/dpfl", {}),
            ("data.store_root", "/proc/sys/dpfl", {}),
            ("data.store_root", "/sys/dpfl", {}),
            ("data.root", "/proc/dpfl", MNIST),
            ("data.root", "/sys/dpfl", {**MNIST, "data.download": True}),
        ]
    ),
    Case(
        "DPFL_CHECKPOINT_DIR /proc",
        run_with(),
        ("checkpoint.dir = '/proc/dpfl'", *PSEUDO),
        {"DPFL_CHECKPOINT_DIR": "/proc/dpfl"},
    ),
    Case(
        "checkpoint dir via a symlink",
        a_symlink("/proc/sys", "checkpoint.dir"),
        ("checkpoint.dir", "/proc/sys/dpfl is in /proc", *PSEUDO),
    ),
    Case(
        "executor auto, RAY_ADDRESS bad",
        run_with({"executor.address": "auto"}),
        ("RAY_ADDRESS = 'h:0'", *NOT_RAY),
        {"RAY_ADDRESS": "h:0"},
    ),
    Case(
        "checkpoint dir ~nobody",
        run_with({"checkpoint.dir": "~no-such-user-dpfl/ck"}),
        ("checkpoint.dir = '~no-such-user-dpfl/ck'", "write the path without ~"),
    ),
    Case(
        "store root name too long",
        run_with({"data.store_root": "x" * 300}),
        ("data.store_root", "File name too long", "choose another directory"),
    ),
    # --- shard stores
    Case(
        "store missing",
        run_with({"data.store": "/nonexistent/store"}),
        ("data.store", "manifest.json unreadable"),
    ),
    Case(
        "manifest not json",
        with_store(lambda s: (s / "manifest.json").write_text("{not json")),
        ("data.store", "manifest.json unreadable", "rebuild"),
    ),
    Case(
        "store format",
        with_store(rewrite_manifest(lambda m: m.update(format_version=1))),
        ("format 1 unsupported",),
    ),
    Case(
        "manifest lacks keys",
        with_store(rewrite_manifest(lambda m: m.pop("x_shape"))),
        ("lacks x_shape",),
    ),
    Case(
        "shard missing",
        with_store(lambda s: (s / "train.arrow").unlink()),
        ("train.arrow unreadable",),
    ),
    Case("shard truncated", with_store(truncate("train.arrow")), ("train.arrow unreadable",)),
    Case("offsets truncated", with_store(truncate("train_offsets.npy")), ("train_offsets.npy",)),
    Case("shard schema", with_store(wrong_schema), ("test.arrow has columns ['a', 'b']",)),
    Case(
        "store of other size",
        with_store(lambda s: None, {"data.num_clients": 12, "executor.num_actors": 2}),
        ("it holds 10 clients", "data.num_clients=10"),
    ),
    Case(
        "built store truncated",
        with_store(truncate("test.arrow"), as_built=True),
        ("test.arrow unreadable", "delete that directory"),
    ),
    Case(
        "store root a file",
        a_file("shards", lambda p: {"data.store_root": str(p)}),
        ("data.store_root", "is a file"),
    ),
    Case("dataset root empty", empty_dataset_root, ("files missing or corrupt", "MNIST")),
    # --- object storage (a missing bucket: tests/test_object_store.py, against a real server)
    Case(
        "store root scheme",
        run_with({"data.store_root": "ftp://host/shards"}),
        ("data.store_root = 'ftp://host/shards'", "scheme 'ftp' is not supported", "s3://"),
    ),
    Case(
        "store root key escapes",
        run_with({"data.store_root": "s3://dpfl/a/../b"}),
        ("data.store_root", "a '..' segment", "single slashes"),
    ),
    Case(
        "store root variable key escapes",
        run_with(),
        ("DPFL_STORE_ROOT = 's3://dpfl/../x'", "a '..' segment"),
        {"DPFL_STORE_ROOT": "s3://dpfl/../x"},
    ),
    Case(
        "checkpoint dir empty segment",
        run_with({"checkpoint.dir": "s3://dpfl//ck"}),
        ("checkpoint.dir", "an empty segment"),
    ),
    Case("data store no bucket", run_with({"data.store": "s3:///x"}), ("data.store", "no bucket")),
    Case(
        "s3 without credentials",
        run_with({"data.store_root": "s3://dpfl/shards"}),
        ("AWS_ACCESS_KEY_ID", "no AWS credentials", "data.store_root s3://dpfl/shards"),
        S3_NO_CREDENTIALS,
    ),
    Case(
        "s3 endpoint down",
        run_with({"checkpoint.dir": "s3://dpfl/ck"}),
        ("AWS_ENDPOINT_URL", "nothing answers at 127.0.0.1", "checkpoint.dir s3://dpfl/ck"),
        S3_DOWN,
    ),
    Case(
        "resume s3 without credentials",
        lambda w, s: ["resume", "s3://dpfl/ck/run.pt"],
        ("AWS_ACCESS_KEY_ID", "CHECKPOINT s3://dpfl/ck/run.pt"),
        S3_NO_CREDENTIALS,
    ),
    Case(
        "resume s3 store without credentials",
        resume_with(checkpoint_payload(changes=["data.store=s3://dpfl/store"])),
        ("AWS_ACCESS_KEY_ID", "no AWS credentials", "data.store s3://dpfl/store"),
        S3_NO_CREDENTIALS,
    ),
    Case(
        "landscape s3 without credentials",
        resume_with(checkpoint_payload(changes=[S3_ROOT]), command="landscape"),
        ("AWS_ACCESS_KEY_ID", "no AWS credentials", "data.store_root s3://dpfl/shards"),
        S3_NO_CREDENTIALS,
    ),
    Case(
        "landscape s3 endpoint down",
        resume_with(checkpoint_payload(changes=[S3_ROOT]), command="landscape"),
        ("AWS_ENDPOINT_URL", "nothing answers at 127.0.0.1", "data.store_root s3://dpfl/shards"),
        S3_DOWN,
    ),
    Case(
        "partition out holds a store",
        partition_into_store,
        ("--out = ", "a shard store is already there", "manifest.json", "another --out", "rm -r"),
    ),
    Case(
        "partition out holds a store, a space in its path",
        lambda w, s: partition_into_store(w, s, "out dir"),
        ("a shard store is already there", "rm -r '", "out dir'`"),
    ),
    Case(
        "partition out holds other files",
        partition_into_other_files,
        ("--out = ", "holds other files (notes, thesis.txt)", "a new or empty folder"),
    ),
    Case(
        "partition out is a file",
        partition_onto_a_file,
        ("--out = ", "unusable (", "a file, not a directory"),
    ),
    Case(
        "s3 store root with an AWS_PROFILE that is no profile",
        run_with({"data": {**BASE["data"], "store_root": "s3://dpfl/shards"}}),
        ("AWS_PROFILE = 'no-such-profile'", "credential chain failed", "no-such-profile"),
        {**S3_NO_CREDENTIALS, "AWS_PROFILE": "no-such-profile"},
    ),
    Case(
        "partition out s3 without credentials",
        lambda w, s: [*PARTITION, "--out", "s3://dpfl/shards"],
        ("AWS_ACCESS_KEY_ID", "no AWS credentials", "--out s3://dpfl/shards"),
        S3_NO_CREDENTIALS,
    ),
    # --- MLflow and Ray
    Case("mlflow scheme", run_with(), ("MLFLOW_TRACKING_URI", "no 'foo' store"), {"M": "foo://x"}),
    Case("mlflow down", run_with(), ("MLFLOW_TRACKING_URI", "nothing answers"), {"M": "http"}),
    # A secret in a URI is never echoed (a job's logs keep the terminal): SECRET is checked for.
    Case(
        "mlflow password in the URI",
        run_with(),
        ("MLFLOW_TRACKING_URI = 'postgresql+psycopg://mlflow:***@127.0.0.1:1/mlflow'",),
        {"M": f"postgresql+psycopg://mlflow:{SECRET}@127.0.0.1:1/mlflow"},
    ),
    Case(
        "mlflow server password in the URI",
        run_with(),
        ("MLFLOW_TRACKING_URI = 'http://admin:***@127.0.0.1:1'", "nothing answers"),
        {"M": f"http://admin:{SECRET}@127.0.0.1:1"},
    ),
    Case(
        "a store URI with a secret key holding a slash, echoed by --set",
        run_with(None, "--set", f"data.store=s3://AKIAIOSFODNN7EXAMPLE:{SECRET}/K7MDENG@bkt/x"),
        ("data.store = 's3://AKIAIOSFODNN7EXAMPLE:***@bkt/x'", "never in the URI"),
    ),
    Case(
        "a password holding a slash and an @",
        run_with(),
        (
            "MLFLOW_TRACKING_URI = 'postgresql+psycopg://mlflow:***@127.0.0.1:1/mlflow'",
            "percent-encode",
        ),
        {"M": f"postgresql+psycopg://mlflow:{SECRET}/x@y@127.0.0.1:1/mlflow"},
    ),
    Case(
        "a password whose digits before a slash read as a port",  # not "nothing answers at"
        run_with(),
        ("MLFLOW_TRACKING_URI = 'http://admin:***@127.0.0.1:1'", "percent-encode"),
        {"M": f"http://admin:1234/{SECRET}@127.0.0.1:1"},
    ),
    Case(
        "checkpoint dir with credentials in the URI",
        run_with(),
        ("DPFL_CHECKPOINT_DIR = ", "AWS_SECRET_ACCESS_KEY", "never in the URI"),
        {"DPFL_CHECKPOINT_DIR": f"s3://AKIAEXAMPLE:{SECRET}@bkt/ck"},
    ),
    Case(
        "mlflow sqlite dir",
        run_with(),
        ("MLFLOW_TRACKING_URI", "directory does not exist"),
        {"M": "sqlite:////nonexistent/dir/m.db"},
    ),
    Case("ray down", run_with(None, "--address", "PORT"), ("executor.address", "nothing answers")),
    Case(
        "restart timeout not a number",
        run_with(),
        ("DPFL_RESTART_TIMEOUT_S = 'abc'", "number of seconds > 0"),
        {"DPFL_RESTART_TIMEOUT_S": "abc"},
    ),
    Case(
        "restart timeout nan",
        run_with(),
        ("DPFL_RESTART_TIMEOUT_S = 'nan'", "number of seconds > 0"),
        {"DPFL_RESTART_TIMEOUT_S": "nan"},
    ),
    Case("ray no port", run_with(None, "--address", "somehost"), ("executor.address", "HOST:PORT")),
    Case(
        "actors exceed machine",
        run_with({"executor.num_actors": 8, "executor.cpus_per_actor": 64}),
        ("executor.cpus_per_actor", "this machine has"),
    ),
    # --- checkpoints
    Case("resume missing", lambda w, s: ["resume", str(w / "none.pt")], ("CHECKPOINT", "no such")),
    Case("resume garbage", resume_with(b"PK\x03\x04garbage"), ("CHECKPOINT", "can read")),
    Case("resume old format", resume_with(FORMAT_0), ("format 0", "git_commit")),
    Case("resume older streams", resume_with(FORMAT_2), ("format 2", "32 bits", "git_commit")),
    Case(
        "resume older computations",
        resume_with(FORMAT_3),
        ("format 3", "pooled statistics", "git_commit"),
    ),
    Case(
        "resume code in pickle",
        resume_with(pickled(code_payload(IN_WORKDIR))),
        ("CHECKPOINT", "does not load (builtins.getattr, pathlib.Path", "was not unpickled"),
    ),
    Case(
        "landscape code in pickle",
        resume_with(pickled(code_payload(IN_WORKDIR)), command="landscape"),
        ("CHECKPOINT", "does not load (builtins.getattr, pathlib.Path"),
    ),
    Case(
        "resume format 1",
        resume_with(pickled(format_1_payload)),
        ("objects this code does not load (", "numpy.dtype", "format 1 held NumPy arrays"),
    ),
    Case("resume a tensor", resume_with(pickled(lambda: torch.zeros(3))), ("holds a Tensor",)),
    Case(
        "resume keys missing",
        resume_with(pickled(lambda: {"format_version": FORMAT_VERSION})),
        ("not a checkpoint of this project", "lacks config, run_id"),
    ),
    Case(
        "resume params a list",
        resume_with(checkpoint_payload(state_change=lambda s: s.update(params=[0.0]))),
        ("its simulation's params is a list",),
    ),
    Case(
        "resume history short",
        resume_with(checkpoint_payload(rounds=2, state_change=lambda s: s["history"].pop())),
        ("history holds rounds 1..1", "rounds_done is 2"),
    ),
    Case(
        "resume feature size",
        resume_with(checkpoint_payload(lambda c: c["data"]["synthetic"].update(num_features=60))),
        ("params hold 410 values", "model (synthetic_logreg, data.source synthetic) has 610"),
    ),
    Case(
        "resume other algorithm",
        resume_with(
            checkpoint_payload(
                state_change=lambda s: s["extras"].update(control=torch.zeros_like(s["params"]))
            )
        ),
        ("server state holds control", "(dp_fedavg) keeps nothing"),
    ),
    Case(
        "resume client outside",
        resume_with(
            checkpoint_payload(
                state_change=lambda s: s.update(client_states={"client_ids": np.array([12])})
            )
        ),
        ("state of client 12", "the config has 10 clients (data.num_clients)"),
    ),
    Case(
        "resume more clients",
        resume_with(checkpoint_payload(lambda c: c["data"].update(num_clients=20), rounds=2)),
        ("accountant charged 2 rounds at σ 1, q 0.5", "charge 2 rounds at σ 1, q 0.25"),
    ),
    Case(
        "resume no accountant",
        resume_with(checkpoint_payload(state_change=lambda s: s.update(accountant=None))),
        ("holds no privacy accountant", "accounts ε (dp_fedavg)"),
    ),
    Case(
        "resume rounds below done",
        resume_with(checkpoint_payload(rounds=2), "--set", "rounds=1"),
        ("rounds = 1", "completed 2 rounds", "N > 2"),
    ),
    Case(
        "resume old config",
        resume_with(UNKNOWN_KEY_IN_CHECKPOINT),
        ("algorithm.retired_option", "another version"),
    ),
    Case(
        "resume changes preset",
        resume_with(checkpoint_payload(), "--set", "algorithm.name=fedavg"),
        ("--set", "keeps its config"),
    ),
    Case(
        "resume in bf16",
        resume_with(checkpoint_payload(), "--set", "executor.precision=bf16"),
        ("--set = 'executor.precision=bf16'", "keeps its checkpoint's precision"),
    ),
    Case(
        "checkpoint dir a file",
        a_file("ckfile", lambda p: {"checkpoint.dir": str(p / "sub")}),
        ("checkpoint.dir", "is a file"),
    ),
    Case(
        "untracked overwrite",
        untracked_overwrite(another_runs_checkpoint),
        ("of another run", "rounds differs"),
    ),
    # --- partitions the data's rows cannot give (found when the store is built; none written)
    Case(
        "shards too many",
        run_with({"data.partition": {"method": "shards", "classes_per_client": 50}}),
        ("data.partition.classes_per_client = 50", "shards but the dataset", "no store"),
    ),
    Case(
        "dirichlet min_size too large",
        run_with({"data.partition": {"method": "dirichlet_class", "alpha": 0.5, "min_size": 90}}),
        ("data.partition.min_size = 90", "lower min_size", "no store was written"),
    ),
    Case(
        "label skew too many rows",
        run_with(
            {
                "data.partition": {"method": "label_skew", "iid_fraction": 0.1},
                "data.num_clients": 11,
            }
        ),
        ("data.partition.samples_per_client", "raise iid_fraction", "no store was written"),
    ),
    Case(
        "test per client too many",
        with_store(lambda store: None, {"data.test_per_client": 100000}),
        ("data.test_per_client = 100000", "test rows of class", "lower per_client"),
    ),
    Case(
        "untracked overwrite code",
        untracked_overwrite(code_in_checkpoint),
        ("checkpoint.dir", "does not read as a checkpoint", "objects this code does not load"),
    ),
    # --- s42 privacy
    Case(
        "ε budget 3e38",
        run_with({"privacy.target_epsilon": 3e38}),
        ("privacy.target_epsilon = 3e+38", "above 100", "at most 100"),
    ),
    Case(
        "one client, default δ",
        run_with({"data.num_clients": 1, "cohort.size": 1}),
        ("privacy.delta = None", "N = 1 client", "set privacy.delta"),
    ),
    # --- s42 config checks
    Case(
        "σ·C beyond float32",
        run_with({"algorithm.noise_multiplier": 3e38, "algorithm.clip_norm": 3e38}),
        ("algorithm.noise_multiplier = 3e+38", "σ·C = 9e+76 is beyond float32's largest"),
    ),
    Case(
        "σ·C·server_lr beyond float32",
        run_with(
            {
                "algorithm.noise_multiplier": 1e20,
                "algorithm.clip_norm": 1e10,
                "algorithm.server_lr": 1e10,
            }
        ),
        ("algorithm.noise_multiplier = 1e+20", "σ·C·algorithm.server_lr = 1e+40"),
    ),
    Case(
        "σ·C·lr beyond float32, sample level",
        run_with(
            {
                "algorithm.name": "dp_fedavg_sample",
                "algorithm.noise_multiplier": 1e20,
                "algorithm.clip_norm": 1e10,
                "algorithm.local.lr": 1e10,
            }
        ),
        ("σ·C·algorithm.local.lr = 1e+40", "lower noise_multiplier or clip_norm"),
    ),
    Case(
        "synthetic options on MNIST",
        run_with({**MNIST, "data.synthetic": {"alpha": 5.0, "num_features": 7}}),
        ("data.synthetic.alpha = 5.0", "only for source synthetic", "reads mnist"),
    ),
    Case(
        "download of synthetic data",
        run_with({"data.download": True}),
        ("data.download = True", "synthetic has none to fetch"),
    ),
    *(
        Case(
            f"{field} on fedavg",
            run_with({**FEDAVG, field: value}),
            (f"{field} = ", "fedavg is non-private; use dp_fedavg or remove it"),
        )
        for field, value in [
            ("privacy.noise_cohort_size", 5),
            ("privacy.accountant", "prv"),
            ("privacy.delta", 0.5),
            ("privacy.population", 100000),
            ("privacy.sampling", "poisson"),
        ]
    ),
    Case(
        "address with the local executor",
        run_with({"executor.kind": "local"}, "--address", "203.0.113.7:6379"),
        ("executor.address = '203.0.113.7:6379'", "the local executor runs in this process"),
    ),
    Case(
        "local threads beyond the machine",
        run_with({"executor.kind": "local", "executor.cpus_per_actor": 1024}),
        ("executor.cpus_per_actor = 1024.0", "each run 1024 torch threads, this machine has"),
    ),
    *(
        Case(
            f"{command} base {name}",
            spec_with_base(command, base),
            ("base = ", "must name a config file inside the directory of the spec"),
        )
        for command in ("sweep", "compare")
        for name, base in [
            ("../ escape", "../" * 12 + "etc/passwd"),
            ("absolute", "/etc/passwd"),
            ("symlink out", "link.yaml"),
        ]
    ),
    Case(
        "PCA task without PCA",
        run_with(MNIST_PCA),
        ("data.pca_components = None", "takes the 60 PCA features", "pca_components: 60"),
    ),
    Case(
        "PCA task with 30 components",
        run_with({**MNIST_PCA, "data.pca_components": 30}),
        ("data.pca_components = 30", "got input shape (30,)", "pca_components: 60"),
    ),
    Case(
        "CNN on PCA features",
        run_with({**MNIST, "data.pca_components": 60}),
        ("data.pca_components = 60", "needs an image shape", "remove data.pca_components"),
    ),
    Case(
        "PCA components beyond the pixels",
        run_with({**MNIST, "data.pca_components": 100000}),
        ("data.pca_components = 100000", "must be in [1, 784]"),
    ),
    # --- s42 data and sizes
    Case(
        "store of other partition",
        with_store(lambda store: None, {"data.partition": {"method": "dirichlet", "alpha": 0.1}}),
        ("data.partition = {", "'method': 'dirichlet'", "set data.partition={method: natural}"),
    ),
    Case(
        "store of other features",
        with_store(lambda store: None, {"data.synthetic.num_features": 20}),
        ("data.synthetic.num_features = 20", "built with 40", "remove data.store"),
    ),
    Case(
        "synthetic model too big",
        run_with({"data.synthetic.num_features": 50000, "data.synthetic.num_classes": 50000}),
        ("data.synthetic = ", "50000 features, 50000 classes", "GiB, this machine has"),
    ),
    Case(
        "sketch tables too big",
        run_with({**SKETCHED, "algorithm.sketch_rows": 1, "algorithm.sketch_cols": 2 * 10**9}),
        ("algorithm.sketch_cols = 2000000000", "float64 sketch tables", "GiB, this machine has"),
    ),
    Case(
        "dirichlet draws over memory",
        run_with({"data.partition": dict(DRAWS, samples_per_client=10**12)}),
        ("data.partition.samples_per_client = 1000000000000", "10 clients × 1000000000000 rows"),
    ),
    Case(
        "dirichlet draws over rows",
        run_with({"data.partition": dict(DRAWS, samples_per_client=1000)}),
        ("data.partition.samples_per_client = 1000", "at most 160", "no store was written"),
    ),
    Case(
        "dirichlet_class min_size 0",
        run_with({"data.partition": {"method": "dirichlet_class", "alpha": 0.5, "min_size": 0}}),
        ("data.partition.min_size = 0", "a client without rows cannot train"),
    ),
    Case(
        "validation fraction holds out none",
        run_with({"data.validation": {"fraction": 0.01}}),
        ("data.validation.fraction = 0.01", "nothing is left to validate", "1/16 = 0.0625"),
    ),
    Case(
        "validation fold empty",
        run_with({"data.validation": {"folds": 1000000, "fold": 999999}}),
        ("data.validation.folds = 1000000", "holds out no row", "at most 16"),
    ),
]


@pytest.fixture(scope="module")
def valid_store(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("valid") / "store"
    build_store(path, *_store_args())
    return path


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
    }


def _environment(case: Case, workdir: Path) -> dict[str, str]:
    uri = case.env.get("M", f"sqlite:///{workdir / 'mlflow.db'}")
    if uri == "http":
        uri = f"http://127.0.0.1:{_free_port()}"
    return {**{k: v for k, v in case.env.items() if k != "M"}, "MLFLOW_TRACKING_URI": uri}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_before_any_work(case, tmp_path, monkeypatch, capsys, valid_store):
    monkeypatch.chdir(tmp_path)
    for name in ("DPFL_STORE_ROOT", "DPFL_CHECKPOINT_DIR", "DPFL_DATA_ROOT", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in _environment(case, tmp_path).items():
        monkeypatch.setenv(name, value)
    argv = [
        f"127.0.0.1:{_free_port()}" if a == "PORT" else a
        for a in case.prepare(tmp_path, valid_store)
    ]
    before = _snapshot(tmp_path)
    capsys.readouterr()

    code = main(argv)

    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in out + err and SECRET not in out + err
    for expected in case.expect:
        assert expected in err, (expected, err)
    assert len(err.strip().splitlines()) <= 12, err  # one paragraph, not a dump
    assert not ray.is_initialized()
    assert _snapshot(tmp_path) == before  # nothing written, nothing created


def test_catalogue_is_large_and_distinct():
    assert len(CASES) >= 120
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.fixture
def no_local_ray(tmp_path, monkeypatch):
    """This machine as Ray's ``auto`` sees it with no cluster: an empty Ray temporary directory
    (no ``ray_current_cluster``) and no raylet process (the scan of the processes behind
    ``find_gcs_addresses`` finds none: other tests may run one)."""
    import ray._private.services as services

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "raytmp"))
    monkeypatch.setattr(services, "_find_address_from_flag", lambda flag: set())
    services.find_gcs_addresses.cache_clear()  # it caches what it found before
    return tmp_path / "raytmp" / "ray" / "ray_current_cluster"


@pytest.mark.parametrize(
    ("cluster_file", "expect"),
    [
        (None, ("RAY_ADDRESS = 'auto'", "no Ray cluster runs on this machine", "ray start")),
        ("127.0.0.1:PORT", ("RAY_ADDRESS = '127.0.0.1:", "nothing answers", "ray start")),
        ("h:abc", ("RAY_ADDRESS = 'h:abc'", "not a Ray address")),
    ],
    ids=["no cluster", "stale cluster file", "malformed cluster file"],
)
def test_ray_address_auto_finds_a_cluster_or_is_refused(
    cluster_file, expect, no_local_ray, tmp_path, monkeypatch, capsys
):
    """RAY_ADDRESS=auto resolves as Ray 2.60 does (the ``ray start`` file, else a raylet):
    nothing found, a stale file or a malformed one is exit 2 before Ray starts."""
    if cluster_file is not None:
        no_local_ray.parent.mkdir(parents=True)
        no_local_ray.write_text(cluster_file.replace("PORT", str(_free_port())))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    config = config_file(tmp_path, {"data.store_root": str(tmp_path / "shards")})
    capsys.readouterr()

    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not ray.is_initialized()
    for expected in expect:
        assert expected in err, (expected, err)
    assert not (tmp_path / "shards").exists()


def test_the_real_command_exits_2_without_a_traceback(tmp_path):
    config = config_file(tmp_path, {"algorithm.clip_norm": -1})
    result = subprocess.run(
        [sys.executable, "-m", "cluster", "run", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "DPFL_STORE_ROOT": str(tmp_path / "never")},
    )
    assert result.returncode == 2
    assert "algorithm.clip_norm = -1.0" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "never").exists()
