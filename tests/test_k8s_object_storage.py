"""The object-storage overlay (issue 31) has no shared volume: every Ray pod reads shards and writes
checkpoints on S3 (a MinIO in the cluster), MLflow stores artifacts there, and the bucket Job's
script is run against a real S3-compatible server (moto, tests/fixtures_s3.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.parse

import pytest

from tests.fixtures_k8s import (
    BUCKET,
    S3_ENDPOINT,
    S3_ENV,
    all_pods,
    by_kind,
    env_values,
    needs_kubectl,
    ray_cluster_specs,
    ray_pod_specs,
    s3_key_refs,
    secret_refs,
)


@needs_kubectl
def test_object_storage_has_no_shared_volume(object_storage):
    """No ReadWriteMany claim, and only MinIO (its own data) and PostgreSQL mount a volume claim:
    pods on different nodes share nothing but the object store."""
    claims = by_kind(object_storage, "PersistentVolumeClaim") + [
        claim
        for sts in by_kind(object_storage, "StatefulSet")
        for claim in sts["spec"].get("volumeClaimTemplates", [])
    ]
    assert len(claims) == 2  # MinIO's data, PostgreSQL's
    for claim in claims:
        assert "ReadWriteMany" not in claim["spec"]["accessModes"], claim["metadata"]["name"]
    mounting = sorted(
        where
        for where, pod, _ in all_pods(object_storage)
        if any("persistentVolumeClaim" in v for v in pod.get("volumes", []))
    )
    assert mounting == ["Deployment/minio"], mounting  # PostgreSQL's is a claim template


@needs_kubectl
def test_every_pod_that_reads_shards_gets_the_s3_variables(object_storage):
    """The Ray pods (drivers on the heads build and read the store, actors on the workers read
    their shards) of both clusters: the store and checkpoints on the bucket, the endpoint of the
    MinIO Service, no metadata probe, the keys from the documented Secret. MLflow and the
    bucket Job name the same bucket and endpoint."""
    ray_pods = [
        (f"{name}/{group}", c)
        for name, spec in ray_cluster_specs(object_storage)
        for group, pod in ray_pod_specs(spec)
        for c in pod["containers"]
    ]
    assert len(ray_pods) == 6  # 2 clusters x (head, cpu, gpu)
    readers = [
        (where, c)
        for where, _, containers in all_pods(object_storage)
        for c in containers
        if "DPFL_STORE_ROOT" in env_values(c)
    ]
    assert sorted(w for w, _ in readers) == sorted(w for w, _ in ray_pods)
    for where, c in ray_pods:
        env = env_values(c)
        assert {k: env.get(k) for k in S3_ENV} == S3_ENV, where
        assert env.get("AWS_DEFAULT_REGION"), where
        assert secret_refs(c) == s3_key_refs(), where

    endpoint = urllib.parse.urlsplit(S3_ENDPOINT)
    (svc,) = [s for s in by_kind(object_storage, "Service") if s["metadata"]["name"] == "minio"]
    assert endpoint.hostname == "minio" and endpoint.port in {
        p["port"] for p in svc["spec"]["ports"]
    }
    (job,) = by_kind(object_storage, "Job")
    (creator,) = job["spec"]["template"]["spec"]["containers"]
    job_env = env_values(creator)
    assert job_env["DPFL_BUCKET"] == BUCKET and job_env["AWS_ENDPOINT_URL"] == S3_ENDPOINT
    assert secret_refs(creator) == s3_key_refs()
    (minio,) = [
        d for d in by_kind(object_storage, "Deployment") if d["metadata"]["name"] == "minio"
    ]
    (server,) = minio["spec"]["template"]["spec"]["containers"]
    assert {k: r["key"] for k, r in secret_refs(server).items()} == {
        "MINIO_ROOT_USER": "AWS_ACCESS_KEY_ID",
        "MINIO_ROOT_PASSWORD": "AWS_SECRET_ACCESS_KEY",
    }
    for where, c in ray_pods:
        for variable in ("DPFL_STORE_ROOT", "DPFL_CHECKPOINT_DIR"):
            assert urllib.parse.urlsplit(env_values(c)[variable]).netloc == BUCKET, where


@needs_kubectl
@pytest.mark.timeout(120)
def test_the_bucket_job_creates_the_bucket_on_a_real_s3_server(object_storage, s3):
    """The Job's own script, with its own variables but the endpoint and keys of moto's server
    on 127.0.0.1: it creates the bucket, and run again keeps it and what it holds."""
    (job,) = by_kind(object_storage, "Job")
    (creator,) = job["spec"]["template"]["spec"]["containers"]
    assert creator["command"][:2] == ["python", "-c"]
    bucket = f"{s3.bucket}-job"
    env = {**os.environ, **env_values(creator), **s3.env}
    env.update(AWS_ENDPOINT_URL=s3.endpoint, DPFL_BUCKET=bucket)
    client = s3.client()

    def create() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", creator["command"][2]],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    first = create()
    assert first.returncode == 0, first.stderr
    assert f"bucket {bucket}: Directory" in first.stdout
    client.head_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key="shards/manifest.json", Body=b"{}")
    again = create()
    assert again.returncode == 0, again.stderr
    listed = client.list_objects_v2(Bucket=bucket)["Contents"]
    assert [o["Key"] for o in listed] == ["shards/manifest.json"]
