"""Shard stores and checkpoints in object storage (issue 31, item 3), against a real
S3-compatible server on 127.0.0.1 (moto's, the ``s3`` fixture of tests/fixtures_s3.py).

A store on S3 reads back as the same store on disk, row for row; a host reads its share of the
rows by byte ranges, never the tables; a run on an S3 store (embedded Ray, 2 actors) ends with
the parameters of the same run on a local store and leaves no local ``s3:`` folder; checkpoints
on S3 are atomic and resume bit for bit; the command line builds, runs and resumes on S3; an
unusable bucket, credentials or endpoint is refused before any work.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from helpers import small_config
from test_bad_input import checkpoint_payload

from actors.scheduling import pin_clients
from cluster.cli.landscape import _default_out
from cluster.cli.main import main
from cluster.config import ConfigError
from cluster.runtime.checkpoint import load_checkpoint, open_checkpoint, save_checkpoint
from cluster.runtime.experiment import run_experiment
from datasets import locations
from datasets.locations import ObjectLocation, parse_location
from datasets.sources import build_store, existing_store_path, store_path
from datasets.store import MANIFEST, ShardStore, StoreError

REPO = Path(__file__).resolve().parents[1]
# Clients of 320 KB of rows each, larger than the hole a ranged read fills in (64 KiB): a host
# reading its share is then seen to read only that.
BIG_CLIENTS = ("data.synthetic.samples_per_user=1000", "data.synthetic.num_features=100")


def _build_both(tmp_path: Path, s3, *overrides: str) -> tuple[ShardStore, ShardStore]:
    """The store of ``small_config`` built on disk and on S3 (under the bucket's ``shards``)."""
    config = small_config(tmp_path / "shards", *overrides)
    return _build(tmp_path / "shards", config), _build(s3.uri("shards"), config)


def _build(root: str | Path, config) -> ShardStore:
    """``config``'s store, built under ``root`` (a directory or an s3:// prefix)."""
    where = store_path(parse_location(root), *config.store_parameters)
    return build_store(where, *config.store_parameters)


def _assert_same_rows(a, b) -> None:
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert a.x.dtype == b.x.dtype and a.x.shape == b.x.shape


def test_a_store_on_s3_reads_as_the_same_store_on_disk(s3, tmp_path):
    local, remote = _build_both(tmp_path, s3)
    key = remote.path.key
    assert isinstance(remote.path, ObjectLocation) and str(remote.path).startswith(s3.uri())
    assert s3.keys(key) == sorted(
        f"{key}/{name}"
        for name in (MANIFEST, "train.arrow", "test.arrow", "train_offsets.npy",
                     "train_class_counts.npy")
    )  # fmt: skip
    remote.check()
    remote.verify()
    assert remote.manifest == local.manifest
    np.testing.assert_array_equal(remote.class_counts(), local.class_counts())
    for cid in (0, 7, local.num_clients - 1):
        _assert_same_rows(remote.client(cid), local.client(cid))
    _assert_same_rows(remote.clients([3, 4, 9, 1]), local.clients([3, 4, 9, 1]))
    _assert_same_rows(remote.train_rows(), local.train_rows())
    _assert_same_rows(remote.test_rows(5, 50), local.test_rows(5, 50))
    index = np.array([40, 3, 3, 17, 0])
    _assert_same_rows(remote.test_take(index), local.test_take(index))
    for a, b in zip(remote.matched_test_sets(5, 0), local.matched_test_sets(5, 0), strict=True):
        np.testing.assert_array_equal(a, b)
    # The manifest commits the store: without it, none is found (nor built over by a reader).
    root, args = parse_location(s3.uri("shards")), small_config(tmp_path).store_parameters
    assert existing_store_path(root, *args) == remote.path
    s3.client().delete_object(Bucket=s3.bucket, Key=f"{key}/{MANIFEST}")
    assert existing_store_path(root, *args) is None


class _Counting:
    """A pyarrow file whose ``read_at`` calls (one ranged GET each) and bytes are counted."""

    def __init__(self, file, log: list[int]):
        self._file, self._log = file, log

    def read_at(self, nbytes: int, offset: int) -> bytes:
        data = self._file.read_at(nbytes, offset)
        self._log.append(len(data))
        return data

    def __getattr__(self, name):
        return getattr(self._file, name)


def test_a_host_reads_its_share_by_ranges_not_the_tables(s3, tmp_path, monkeypatch):
    from actors.client_host import ClientHost

    config = small_config(tmp_path, *BIG_CLIENTS)
    remote = _build(s3.uri("shards"), config)
    fetched: dict[str, list[int]] = {"train.arrow": [], "test.arrow": []}
    opened = locations.open_input_file

    def counting(location):
        return _Counting(opened(location), fetched[location.name])

    monkeypatch.setattr(locations, "open_input_file", counting)
    table_bytes = s3.client().head_object(Bucket=s3.bucket, Key=f"{remote.path.key}/train.arrow")
    row_bytes = 100 * 4 + 8
    hosted = pin_clients(remote.client_sizes, 4)[1]  # a host of 4: every 4th client or so
    share = int(remote.client_sizes[hosted].sum()) * row_bytes

    host = ClientHost(remote.location, config.task, config.build_algorithm(), 0, hosted)

    reads = fetched["train.arrow"]
    # Its clients' rows, the first client's once more (the preload's size estimate) and at most
    # the gaps between its clients' labels (8 bytes a row: gaps below 64 KiB are read through).
    estimate = int(remote.client_sizes[hosted[0]]) * row_bytes
    labels = int(remote.offsets[-1]) * 8
    assert share + estimate <= sum(reads) <= share + estimate + labels, (sum(reads), share)
    assert sum(reads) < table_bytes["ContentLength"] / 3
    assert len(reads) <= 2 * len(hosted) + 2  # at most x and y of each client, and the estimate
    rows = host.data[hosted[2]]
    np.testing.assert_array_equal(rows[1].numpy(), remote.client(hosted[2]).y)
    # Neighbouring clients are one request per column, not one per client.
    reads.clear()
    remote.clients(list(range(4, 12)))
    assert len(reads) == 2
    assert sum(reads) == int(remote.client_sizes[4:12].sum()) * row_bytes


def _final_params(config) -> torch.Tensor:
    return run_experiment(config).result.params


def _objects(s3, prefix: str) -> list[str]:
    """The objects under ``prefix``, without the empty ``dir/`` markers pyarrow keeps."""
    return [k for k in s3.keys(prefix) if not k.endswith("/")]


@pytest.mark.slow  # an embedded Ray and its actors: 35-95 s on 2 loaded cores
@pytest.mark.timeout(300)
def test_a_ray_run_on_an_s3_store_equals_the_run_on_a_local_store(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # A local run with as many host threads as actors is the Ray run, bit for bit
    # (test_equivalence.py): the reference costs no second Ray start.
    on_disk = _final_params(small_config(tmp_path / "shards", "executor.num_actors=2"))
    ray_run = ("executor.kind=ray", "executor.num_actors=2", "executor.cpus_per_actor=0.5")
    ray_run += ("executor.overlap_start=false",)  # the actors run every round
    config = small_config(s3.uri("shards"), *ray_run, f"checkpoint.dir={s3.uri('checkpoints')}")
    try:
        outcome = run_experiment(config)
    finally:
        ray.shutdown()

    assert torch.equal(outcome.result.params, on_disk)
    store_keys = _objects(s3, "shards/")
    assert any(k.endswith(f"/{MANIFEST}") for k in store_keys) and len(store_keys) == 5
    assert str(outcome.checkpoint) == s3.uri("checkpoints", outcome.checkpoint.name)
    assert _objects(s3, "checkpoints/") == [f"checkpoints/{outcome.checkpoint.name}"]
    saved = load_checkpoint(str(outcome.checkpoint))
    assert torch.equal(saved["simulation"]["params"], on_disk)
    # Nothing went to a local folder named after the URI, here or in the repository.
    assert not any(p.name.startswith("s3:") for p in tmp_path.rglob("*"))
    assert not (REPO / "s3:").exists()


def test_a_run_on_s3_checkpointed_on_s3_resumes_bit_for_bit(s3, tmp_path):
    """Store and checkpoints on S3, two host threads reading the store by ranges: the stopped
    and resumed run ends where an uninterrupted run on a local store does."""
    scaffold = ("algorithm.name=scaffold", "executor.num_actors=2")
    straight = _final_params(small_config(tmp_path, *scaffold, "rounds=4", "checkpoint.every=0"))
    on_s3 = (s3.uri("shards"), *scaffold, f"checkpoint.dir={s3.uri('runs', 'ck')}")
    first = run_experiment(small_config(*on_s3, "rounds=2", "tracking.run_name=a"))
    assert isinstance(first.checkpoint, ObjectLocation)

    saved, config = open_checkpoint(str(first.checkpoint), ["rounds=4"])
    resumed = run_experiment(config, resume=saved)

    assert torch.equal(resumed.result.params, straight)
    assert _objects(s3, "runs/") == [f"runs/ck/{first.checkpoint.name}"]  # no temporary key


def test_a_checkpoint_write_that_fails_leaves_the_previous_one(s3):
    path = parse_location(s3.uri("ck", "run.pt"))
    locations.write_atomic(path, lambda f: f.write(b"previous"))

    def fails_midway(file) -> None:
        file.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        locations.write_atomic(path, fails_midway)
    assert locations.read_bytes(path) == b"previous"
    with pytest.raises(AttributeError):  # torch.save of something it cannot pickle
        save_checkpoint(path, {"history": [], "client_states": {}, "x": lambda: 0}, {}, None)
    assert locations.read_bytes(path) == b"previous"
    assert _objects(s3, "ck/") == ["ck/run.pt"]


@pytest.mark.slow  # a subprocess's imports and a run: ≈ 40 s on 2 loaded cores
@pytest.mark.timeout(300)
def test_the_command_line_partitions_runs_and_resumes_on_s3(s3, tmp_path, monkeypatch, capsys):
    store = s3.uri("prepared", "synthetic-20")
    built = subprocess.run(
        [sys.executable, "-m", "cluster", "partition", "--dataset", "synthetic",
         "--clients", "20", "--method", "natural", "--out", store],
        capture_output=True, text=True, cwd=tmp_path, timeout=240,
        env={**os.environ, **s3.env, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert f"report: {store}/report/class_histogram.png" in built.stdout
    assert f"prepared/synthetic-20/{MANIFEST}" in s3.keys("prepared/")
    # `run` and `resume` in process, as `python -m cluster` runs them (test_bad_input.py).
    monkeypatch.chdir(tmp_path)
    settings = ["--executor", "local", "--set", "rounds=2", "--set", "cohort.size=5",
                "--set", f"data.store={store}", "--set", "data.num_clients=20",
                "--set", "data.synthetic.samples_per_user=5000",
                "--set", f"checkpoint.dir={s3.uri('ck')}",
                "--set", "tracking.enabled=false"]  # fmt: skip
    assert main(["run", str(REPO / "configs/quickstart.yaml"), *settings]) == 0
    (checkpoint,) = _objects(s3, "ck/")
    assert main(["resume", s3.uri(checkpoint), "--set", "rounds=3"]) == 0
    assert "resuming after round 2" in capsys.readouterr().out
    assert load_checkpoint(s3.uri(checkpoint))["simulation"]["rounds_done"] == 3
    assert list(tmp_path.iterdir()) == []  # nothing local, no `s3:` folder


# ------------------------------------------------------------------------------ bad input


def _refused(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not ray.is_initialized()
    return err


def _config_file(tmp_path: Path, **sections) -> str:
    path = tmp_path / "c.yaml"
    data = {"num_clients": 20, "synthetic": {"samples_per_user": 20}}
    path.write_text(json.dumps({"data": data, **sections}))
    return str(path)


def test_a_missing_bucket_is_refused_before_any_work(s3, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPFL_STORE_ROOT", "s3://no-such-bucket/shards")
    err = _refused(["run", _config_file(tmp_path), "--executor", "local"], capsys)
    assert "data.store_root = 's3://no-such-bucket/shards'" in err
    assert "bucket 'no-such-bucket' does not exist" in err and "aws s3 mb" in err
    out = s3.uri("missing", "x")
    err = _refused(["resume", out.replace(s3.bucket, "no-such-bucket")], capsys)
    assert "CHECKPOINT" in err and "does not exist" in err
    assert list(tmp_path.iterdir()) == [tmp_path / "c.yaml"]


def test_partition_refuses_an_unusable_out_before_reading_data(s3, tmp_path, capsys):
    argv = ["partition", "--dataset", "synthetic", "--clients", "4", "--method", "natural"]
    err = _refused([*argv, "--out", "s3://no-such-bucket/x"], capsys)
    assert "--out = 's3://no-such-bucket/x'" in err and "does not exist" in err
    err = _refused([*argv, "--out", s3.uri("a", "..", "b")], capsys)
    assert "'..' segment" in err
    assert s3.keys() == []


def _silent_server() -> socket.socket:
    """A socket on 127.0.0.1 that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    return server


@pytest.mark.timeout(30)
def test_an_endpoint_that_never_answers_fails_within_seconds(s3, tmp_path, monkeypatch, capsys):
    with _silent_server() as server:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setenv("DPFL_STORE_ROOT", s3.uri("shards"))
        start = time.monotonic()
        err = _refused(["run", _config_file(tmp_path), "--executor", "local"], capsys)
    assert time.monotonic() - start < 15
    assert "data.store_root" in err and "refused or did not answer" in err


def test_location_checks_keep_keys_inside_their_prefix(monkeypatch):
    for bad in ("s3://b/a/../c", "s3://b//c", "s3://b/./c", "s3:///c", "gs://b/c", "ftp://h/x"):
        with pytest.raises(ValueError):
            parse_location(bad)
    assert parse_location("s3://b/a/c/") == ObjectLocation("b", "a/c")
    assert parse_location("file:///tmp/x") == parse_location("file://localhost/tmp/x")
    assert parse_location("file:///tmp/x") == Path("/tmp/x")
    with pytest.raises(ValueError, match="names the host 'shards'; write file:///ABSOLUTE/PATH"):
        parse_location("file://shards/x")  # not the relative path shards/x
    with pytest.raises(ValueError, match="names no path"):
        parse_location("file://")
    assert parse_location("file:///tmp/a%20b") == Path("/tmp/a b")
    with pytest.raises(ValueError, match="goes in AWS_ENDPOINT_URL"):
        parse_location("s3://minio:9000/dpfl/shards")
    with pytest.raises(ValueError, match="never in the URI") as refused:
        parse_location("s3://ghp_T0KENx@bkt/x")
    assert "T0KEN" not in str(refused.value)
    for bad in ("file://", "file://localhost", "file:///tmp/a%00b", "file://u:p@host/x"):
        with pytest.raises(ValueError, match="the file:// URI") as refused:
            parse_location(bad)
        assert "u:p" not in str(refused.value)
    with pytest.raises(ValueError, match="never in the URI") as refused:
        parse_location("s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY@bkt/ck")
    assert "wJalrXUtnFEMI" not in str(refused.value) and "bPxRfiCY" not in str(refused.value)
    with pytest.raises(ValueError, match=r"the bucket 'b\$\(x\)' is no bucket name"):
        parse_location("s3://b$(x)/k")
    # '.' and '..' are path segments to the client: s3://../victim/k read bucket "victim"
    for bad in ("..", ".", "a..b", ".a", "a-", "_a"):
        with pytest.raises(ValueError, match="is no bucket name"):
            parse_location(f"s3://{bad}/victim/k")
    for good in ("a", "dpfl", "my.bucket-1", "A_b.c"):
        assert parse_location(f"s3://{good}/k").bucket == good
    joined = parse_location("s3://b/root") / Path("../escape")
    with pytest.raises(ValueError, match=r"'\.\.' segment"):
        _ = joined.path  # never requested
    # `landscape` writes its plots beside a local checkpoint, never to a folder named `s3:`.
    assert _default_out("s3://b/ck/run.pt") == Path("run-landscape")
    assert _default_out("ck/run.pt") == Path("ck/run-landscape")
    # In a Ray job a relative checkpoint.dir goes under the store root: never above it.
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    assert small_config("s3://b/root", "checkpoint.dir=ck").checkpoint_dir == ObjectLocation(
        "b", "root/ck"
    )
    config = small_config("s3://b/root", "checkpoint.dir=../up")
    with pytest.raises(ConfigError, match=r"checkpoint\.dir = 's3://b/root/\.\./up'"):
        _ = config.checkpoint_dir


# ---------------------------------------------------------------------- large objects, access


def test_an_object_above_the_copy_threshold_is_copied_in_parts(s3, monkeypatch):
    """S3 refuses a single CopyObject above 5 GiB: ``write_atomic`` copies a large temporary
    object onto its key in parts (the threshold lowered here to S3's smallest part, 5 MiB)."""
    monkeypatch.setattr(locations, "MULTIPART_COPY_THRESHOLD", 5 * 2**20)
    monkeypatch.setattr(locations, "MULTIPART_COPY_CHUNK", 5 * 2**20)
    content = np.random.default_rng(0).bytes(12 * 2**20)  # 3 parts: 5, 5 and 2 MiB
    path = parse_location(s3.uri("ck", "big.pt"))
    locations.write_atomic(path, lambda f: f.write(b"previous"))
    small = s3.client().head_object(Bucket=s3.bucket, Key="ck/big.pt")["ETag"]

    locations.write_atomic(path, lambda f: f.write(content))

    assert locations.read_bytes(path) == content
    etag = s3.client().head_object(Bucket=s3.bucket, Key="ck/big.pt")["ETag"]
    assert etag.strip('"').endswith("-3"), etag  # a multipart object's ETag counts its parts
    assert "-" not in small.strip('"')  # below the threshold: one CopyObject
    assert _objects(s3, "ck/") == ["ck/big.pt"]  # no temporary key
    assert s3.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []


def test_a_failed_copy_is_an_os_error_and_leaves_the_previous_object(s3, monkeypatch):
    """The copy's request refused (a bad signature): an ``OSError`` naming both keys, as
    pyarrow's failures are; the previous object and no temporary key remain."""
    import boto3

    path = parse_location(s3.uri("ck", "run.pt"))
    locations.write_atomic(path, lambda f: f.write(b"previous"))
    user = _as_iam_user(s3, monkeypatch, ["s3:*"])
    bad = {**user, "AWS_SECRET_ACCESS_KEY": "wrong"}
    monkeypatch.setattr(
        locations,
        "s3_client",
        lambda **_: boto3.client(
            "s3",
            endpoint_url=s3.endpoint,
            aws_access_key_id=bad["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=bad["AWS_SECRET_ACCESS_KEY"],
        ),
    )
    with pytest.raises(OSError, match=r"copying s3://.*\.partial to s3://.*/ck/run\.pt"):
        locations.write_atomic(path, lambda f: f.write(b"new"))
    assert locations.read_bytes(path) == b"previous"
    monkeypatch.undo()
    assert _objects(s3, "ck/") == ["ck/run.pt"]


def _as_iam_user(s3, monkeypatch, actions: list[str]) -> dict:
    """Turn on moto's request authorisation (this process's server; ``monkeypatch.undo`` turns
    it off) and point the AWS variables at a new IAM user allowed only ``actions``."""
    import boto3
    from moto import settings

    iam = boto3.client("iam", endpoint_url=s3.endpoint)
    user = f"dpfl-{s3.bucket}"
    iam.create_user(UserName=user)
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": actions, "Resource": "*"}]}  # fmt: skip
    iam.put_user_policy(UserName=user, PolicyName="only", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    credentials = {
        "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
    }
    for name, value in credentials.items():
        monkeypatch.setenv(name, value)
    return credentials


# What a read-only key holds; moto names HeadBucket's permission s3:HeadBucket (AWS: ListBucket).
BUCKET_ONLY = ["s3:ListBucket", "s3:HeadBucket"]
READ_ONLY = [*BUCKET_ONLY, "s3:GetObject"]


@pytest.mark.timeout(60)
def test_a_checkpoint_dir_these_credentials_cannot_write_is_refused_before_any_work(
    s3, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    config = _config_file(tmp_path, checkpoint={"dir": s3.uri("ck")}, tracking={"enabled": False})
    _as_iam_user(s3, monkeypatch, READ_ONLY)
    err = _refused(["run", config, "--executor", "local"], capsys)
    assert f"checkpoint.dir = '{s3.uri('ck')}'" in err
    assert "cannot write under" in err and "s3:PutObject" in err and "AccessDenied" in err
    monkeypatch.undo()
    assert s3.keys() == []
    assert list(tmp_path.iterdir()) == [tmp_path / "c.yaml"]


@pytest.mark.timeout(60)
def test_a_checkpoint_dir_these_credentials_can_write_passes_and_keeps_no_probe(
    s3, tmp_path, monkeypatch
):
    from cluster.runtime.storage_checks import check_writable_location

    _as_iam_user(s3, monkeypatch, [*READ_ONLY, "s3:PutObject", "s3:DeleteObject"])
    check_writable_location("checkpoint.dir", parse_location(s3.uri("ck")))
    monkeypatch.undo()
    assert s3.keys() == []  # the probe was deleted


@pytest.mark.timeout(60)
def test_partition_refuses_an_out_these_credentials_cannot_write(s3, tmp_path, capsys, monkeypatch):
    _as_iam_user(s3, monkeypatch, READ_ONLY)
    argv = ["partition", "--dataset", "synthetic", "--clients", "4", "--method", "natural"]
    err = _refused([*argv, "--out", s3.uri("shards")], capsys)
    assert f"--out = '{s3.uri('shards')}'" in err and "cannot write under" in err
    monkeypatch.undo()
    assert s3.keys() == []


@pytest.mark.timeout(120)
def test_a_checkpoints_store_these_credentials_cannot_read_names_the_credentials(
    s3, tmp_path, monkeypatch, capsys
):
    """``resume``/``landscape`` of a checkpoint whose ``data.store`` the credentials may not
    read: the AWS variables are at fault, not the store (rebuilding it would not help)."""
    store = _build(s3.uri("shards"), small_config(tmp_path))
    path = tmp_path / "run.pt"
    checkpoint_payload(changes=[f"data.store={store.location}"])(path)
    open_checkpoint(str(path))  # these credentials read it
    _as_iam_user(s3, monkeypatch, BUCKET_ONLY)  # the bucket, not its objects
    with pytest.raises(ConfigError) as refused:
        open_checkpoint(str(path))
    message = str(refused.value)
    assert message.startswith("config error: AWS_ACCESS_KEY_ID = ") and "may not read" in message
    assert f"shard store {store.location}" in message and "ACCESS_DENIED" in message
    assert "rebuild" not in message


def test_partition_refuses_an_out_that_holds_a_store(s3, tmp_path, capsys):
    """Running jobs may read the store at --out: it is never rewritten in place."""
    config = small_config(tmp_path)
    store = _build(s3.uri("shards"), config)
    before = {
        item["Key"]: item["ETag"]
        for item in s3.client().list_objects_v2(Bucket=s3.bucket)["Contents"]
    }
    argv = ["partition", "--dataset", "synthetic", "--clients", "4", "--method", "natural"]
    err = _refused([*argv, "--out", store.location], capsys)
    assert f"--out = '{store.location}'" in err and f"{store.location}/{MANIFEST}" in err
    assert "aws s3 rm --recursive" in err and "another --out" in err
    after = {
        item["Key"]: item["ETag"]
        for item in s3.client().list_objects_v2(Bucket=s3.bucket)["Contents"]
    }
    assert after == before


def test_partition_refuses_an_out_that_holds_other_objects(s3, tmp_path, capsys):
    s3.client().put_object(Bucket=s3.bucket, Key="mine/thesis.txt", Body=b"years of work")
    argv = ["partition", "--dataset", "synthetic", "--clients", "4", "--method", "natural"]
    err = _refused([*argv, "--out", s3.uri("mine")], capsys)
    assert "holds other files (thesis.txt)" in err and "a new or empty folder" in err
    keys = [item["Key"] for item in s3.client().list_objects_v2(Bucket=s3.bucket)["Contents"]]
    assert keys == ["mine/thesis.txt"]


def test_a_second_builder_of_a_store_never_changes_the_committed_one(s3, tmp_path, monkeypatch):
    """Two trials building one content-keyed store at once, both past the check for its
    manifest. The second's objects need not be the same bytes (PCA's SVD varies with the
    machine): it used to delete the first's manifest first (the store unreadable until its own
    upload ended) and replace every object. Now, with the manifest there it uploads nothing,
    and a manifest that appears meanwhile stops it before its next object; the objects of a
    writer that died before its manifest are replaced."""
    config = small_config(tmp_path)
    where = store_path(parse_location(s3.uri("shards")), *config.store_parameters)
    build_store(where, *config.store_parameters)

    def objects() -> dict[str, str]:
        listed = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=where.key)["Contents"]
        return {item["Key"]: item["ETag"] for item in listed}

    def other_bytes(folder: Path) -> None:  # the second machine's build of the same store
        _copy_store(where, folder)
        for path in folder.rglob("*.npy"):
            path.write_bytes(path.read_bytes() + b"\0")

    before, real_exists = objects(), locations.exists
    copied: list[str] = []
    real_copy = locations.pafs.copy_files
    monkeypatch.setattr(
        locations.pafs, "copy_files", lambda *a, **k: copied.append(a[1]) or real_copy(*a, **k)
    )
    locations.upload_folder(_filled(tmp_path / "a", other_bytes), where, MANIFEST)
    assert copied == [] and objects() == before  # committed: nothing uploaded
    checks = iter([False, True])  # the first writer commits after our first object
    monkeypatch.setattr(locations, "exists", lambda loc: next(checks, True))
    locations.upload_folder(_filled(tmp_path / "b", other_bytes), where, MANIFEST)
    assert len(copied) == 1 and (where / MANIFEST).path not in copied  # stopped at once
    folder = _filled(tmp_path / "c", other_bytes)  # with the manifest
    s3.client().delete_object(Bucket=s3.bucket, Key=f"{where.key}/{MANIFEST}")
    monkeypatch.setattr(locations, "exists", real_exists)  # a writer that died: replaced
    locations.upload_folder(folder, where, MANIFEST)
    after = objects()
    assert set(after) == set(before) and after != before, (sorted(after), sorted(before))


def _filled(folder: Path, fill) -> Path:
    folder.mkdir()
    fill(folder)
    return folder


def _copy_store(where: ObjectLocation, folder: Path) -> None:
    """The second builder's files: the same store's objects, downloaded."""
    for item in locations.s3_client().list_objects_v2(Bucket=where.bucket, Prefix=where.key)[
        "Contents"
    ]:
        target = folder / item["Key"][len(where.key) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(locations.read_bytes(ObjectLocation(where.bucket, item["Key"])))


def test_a_relative_store_path_is_sent_to_actors_absolute(tmp_path, monkeypatch):
    """An actor's working directory is wherever its worker started (a head's, for a run by
    address): a relative ``data.store`` opened there would be another store, or none."""
    config = small_config(tmp_path / "shards")
    store = _build(tmp_path / "shards", config)
    monkeypatch.chdir(store.path.parent)
    opened = ShardStore.open(store.path.name)
    assert opened.location == str(store.path) and Path(opened.location).is_absolute()


@pytest.mark.parametrize(
    "layout", [{}, {"test.arrow": {"x": [-8, 8], "y": [0, 8]}}, {"test.arrow": "x"}]
)
def test_a_malformed_layout_in_an_s3_manifest_is_a_store_error(s3, tmp_path, layout):
    config = small_config(tmp_path)
    store = _build(s3.uri("shards"), config)
    manifest = json.loads(locations.read_bytes(store.path / MANIFEST))
    manifest["layout"] = {**manifest["layout"], **layout}
    if not layout:
        del manifest["layout"]["test.arrow"]
    key = f"{store.path.key}/{MANIFEST}"
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=json.dumps(manifest).encode())
    with pytest.raises(StoreError, match="test.arrow"):
        ShardStore.open(store.location).check()


@pytest.mark.timeout(60)
def test_a_validation_store_these_credentials_cannot_write_beside_is_refused_before_any_work(
    s3, tmp_path, monkeypatch, capsys
):
    """``data.validation`` writes its store beside ``data.store``: read-only credentials passed
    the preflight and failed in the store's opening with a traceback."""
    monkeypatch.chdir(tmp_path)
    store = _build(s3.uri("shards"), small_config(tmp_path))
    before = s3.keys()
    config = _config_file(
        tmp_path,
        data={**small_config(tmp_path).to_dict()["data"], "store": store.location,
              "store_root": str(tmp_path), "validation": {"fraction": 0.2}},
        checkpoint={"dir": str(tmp_path / "ck")}, tracking={"enabled": False},
    )  # fmt: skip
    _as_iam_user(s3, monkeypatch, READ_ONLY)
    err = _refused(["run", config, "--executor", "local"], capsys)
    assert f"data.validation = '{store.path.parent}'" in err and "cannot write under" in err
    monkeypatch.undo()
    assert s3.keys() == before


@pytest.mark.timeout(120)
def test_a_store_that_stops_answering_mid_run_ends_it_in_one_paragraph(
    s3, tmp_path, monkeypatch, capsys
):
    """Rows fetched by ranges while the run trains (a host's cache, an evaluation): an endpoint
    that stopped answering ended the run with a traceback; now one paragraph, exit 1, saying
    to resume once the store answers (not to rebuild it: nothing is damaged)."""
    import pickle

    from datasets import store as store_module
    from datasets.store import StoreReadFailed

    monkeypatch.chdir(tmp_path)
    built = _build(s3.uri("shards"), small_config(tmp_path))
    config = _config_file(
        tmp_path,
        data={**small_config(tmp_path).to_dict()["data"], "store": built.location},
        checkpoint={"dir": str(tmp_path / "ck")}, tracking={"enabled": False},
    )  # fmt: skip

    def endpoint_gone(file, ranges):
        raise OSError("AWS Error NETWORK_CONNECTION during GetObject operation: timed out")

    monkeypatch.setattr(store_module, "read_ranges", endpoint_gone)
    assert main(["run", config, "--executor", "local"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: shard store {built.location}: rows could not be read (AWS Error")
    assert "resume it from its last checkpoint" in err and "Traceback" not in err
    failure = StoreReadFailed(built.location, "timed out")
    assert str(pickle.loads(pickle.dumps(failure))) == str(failure)  # as Ray sends it
    # An actor (re)opening the store while the endpoint is away (after a node loss): not a
    # damaged store to delete and rebuild, as StoreError says, but one to resume from (review M)
    with _silent_server() as server:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        server.close()  # nothing listens there now: the connection is refused
        with pytest.raises(StoreReadFailed, match="once the store answers"):
            ShardStore.open(built.location)
