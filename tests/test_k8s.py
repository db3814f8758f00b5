"""Offline checks of the Kubernetes deployment in k8s/ (KubeRay + MLflow on PostgreSQL): what each
layout renders, the Ray objects read semantically, the core objects' structure, the Secret the
README documents and MLflow's use of it, and a client-side dry run.

Nothing in the test_k8s* modules talks to a cluster (the rendering: tests/fixtures_k8s.py). The
others: the KubeRay CRD schemas (test_k8s_crds), the hardening of issue 29 (test_k8s_security,
test_k8s_images, test_k8s_network), the object-storage overlay of issue 31
(test_k8s_object_storage).
"""

from __future__ import annotations

import os
import re
import subprocess
import urllib.parse
from pathlib import Path

import pytest
import yaml

from tests.fixtures_k8s import (
    BUCKET,
    DOCUMENTED_SECRET,
    DOCUMENTED_SECRETS,
    K8S,
    KUBECTL,
    LAYOUTS,
    OBJECT_STORAGE,
    REPO,
    S3_ENDPOINT,
    S3_ENV,
    S3_KEYS,
    by_kind,
    env_values,
    locked_version,
    needs_kubectl,
    pod_templates,
    ray_cluster_specs,
    ray_pod_specs,
    s3_key_refs,
    secret_refs,
)

# The image's container paths, read from k8s/Dockerfile (the manifests must agree with it).
IMAGE_ENV = dict(re.findall(r"\b(APP_HOME|DPFL_\w+)=(\S+)", (K8S / "Dockerfile").read_text()))
APP_HOME = IMAGE_ENV.pop("APP_HOME")  # the image's WORKDIR / PYTHONPATH
RAY_ENV = {"MLFLOW_TRACKING_URI": "http://mlflow:5000", **IMAGE_ENV}
PRIVATE_TMP = "/tmp/dpfl"
PRIVATE_TMP_COMMAND = ["sh", "-c", f"mkdir -p {PRIVATE_TMP} && chmod 700 {PRIVATE_TMP}"]
SHARED_MOUNT = os.path.commonpath(list(IMAGE_ENV.values()))  # the dpfl-shared volume
_BASE_KINDS = [
    ("v1", "Service"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("apps/v1", "StatefulSet"),
    ("ray.io/v1", "RayCluster"),
    ("ray.io/v1", "RayJob"),
] + [("networking.k8s.io/v1", "NetworkPolicy")] * 6
_SHARED_VOLUMES = [("v1", "PersistentVolumeClaim")] * 2  # dpfl-shared, mlflow-artifacts
# MinIO (its data PVC, Service, Deployment, NetworkPolicy) and the bucket Job, no shared PVC.
_OBJECT_STORE = [
    ("v1", "PersistentVolumeClaim"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("batch/v1", "Job"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
]
EXPECTED_KINDS = {
    "base": sorted(_BASE_KINDS + _SHARED_VOLUMES),
    "overlays/local": sorted(_BASE_KINDS + _SHARED_VOLUMES),
    OBJECT_STORAGE: sorted(_BASE_KINDS + _OBJECT_STORE),
}
CORE_KINDS = {"Service", "PersistentVolumeClaim", "Deployment", "StatefulSet", "Job"}


def test_every_layout_is_known():
    """A new overlay is rendered and validated like the others once it has its expected kinds."""
    assert set(LAYOUTS) == set(EXPECTED_KINDS), "add the new layout to EXPECTED_KINDS"


@needs_kubectl
def test_render_has_exactly_the_expected_kinds(rendered):
    where, docs = rendered
    assert sorted((d["apiVersion"], d["kind"]) for d in docs) == EXPECTED_KINDS[where]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert len(names) == len(docs), "duplicate object names"


@needs_kubectl
def test_ray_clusters(rendered):
    where, docs = rendered
    for name, spec in ray_cluster_specs(docs):
        assert spec["enableInTreeAutoscaling"] is True, name
        assert spec["rayVersion"] == locked_version("ray"), name
        head = spec["headGroupSpec"]["rayStartParams"]
        assert head["num-cpus"] == "0" and head["dashboard-host"] == "0.0.0.0", name
        groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
        assert set(groups) == {"cpu", "gpu"}, name
        gpu = groups["gpu"]
        assert gpu["minReplicas"] == 0 and gpu["replicas"] == 0, name
        (gpu_container,) = gpu["template"]["spec"]["containers"]
        assert "nvidia.com/gpu" in gpu_container["resources"]["limits"], name
        assert gpu_container["image"].endswith("-gpu"), name
        if where == "overlays/local":
            assert gpu["maxReplicas"] == 0, name
            assert groups["cpu"]["replicas"] == groups["cpu"]["maxReplicas"] == 1, name
        expected_env = {**RAY_ENV, **S3_ENV} if where == OBJECT_STORAGE else RAY_ENV
        for group, pod in ray_pod_specs(spec):
            volumes = {v["name"]: v for v in pod["volumes"]}
            claims = {
                n: v["persistentVolumeClaim"]["claimName"]
                for n, v in volumes.items()
                if "persistentVolumeClaim" in v
            }
            (init,) = pod["initContainers"]  # TMPDIR made private in the /tmp emptyDir
            assert init["command"] == PRIVATE_TMP_COMMAND, (name, group)
            assert {"name": "tmp", "mountPath": "/tmp"} in init["volumeMounts"], (name, group)
            assert init["image"] == pod["containers"][0]["image"], (name, group)
            for c in pod["containers"]:
                env = {e["name"]: e.get("value") for e in c["env"]}
                assert {k: env.get(k) for k in expected_env} == expected_env, (name, group)
                assert (env["TMPDIR"], env["RAY_TMPDIR"]) == (PRIVATE_TMP, "/tmp"), (name, group)
                assert c["image"].startswith("dpfl-cluster:"), (name, group)
                assert c["resources"]["limits"]["cpu"], (name, group)
                mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                if where == OBJECT_STORAGE:  # no volume shared: raw downloads in pod scratch
                    assert not claims, (name, group, claims)
                    assert "emptyDir" in volumes[mounts[env["DPFL_DATA_ROOT"]]], (name, group)
                else:
                    assert claims.get(mounts.get(SHARED_MOUNT)) == "dpfl-shared", (name, group)


@needs_kubectl
def test_rayjob_lifecycle(rendered):
    _, docs = rendered
    (job,) = by_kind(docs, "RayJob")
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] > 0
    assert "rayClusterSpec" in spec and "clusterSelector" not in spec


def entrypoint_config(entrypoint: str) -> Path:
    m = re.fullmatch(r"python -m cluster run (\S+\.ya?ml)(\s.*)?", entrypoint.strip())
    assert m, f"unexpected entrypoint: {entrypoint!r}"
    path = m.group(1)
    if path.startswith(APP_HOME + "/"):
        path = path[len(APP_HOME) + 1 :]
    return REPO / path


def test_rayjob_entrypoint_config_loads():
    from cluster.config import load_config

    job = yaml.safe_load((K8S / "base" / "rayjob.yaml").read_text())
    path = entrypoint_config(job["spec"]["entrypoint"])
    assert path.is_file(), path
    config = load_config(path)
    assert config.executor.kind == "ray"
    # The local overlay's one CPU worker advertises 2 CPUs (the head advertises 0).
    assert config.executor.num_actors * config.executor.cpus_per_actor <= 2
    assert config.executor.gpus_per_actor == 0


@needs_kubectl
def test_core_objects_structure(rendered):
    where, docs = rendered
    api = {
        "Service": "v1",
        "PersistentVolumeClaim": "v1",
        "Deployment": "apps/v1",
        "StatefulSet": "apps/v1",
        "Job": "batch/v1",
    }
    core = [d for d in docs if d["kind"] in CORE_KINDS]
    for d in core:
        assert d["apiVersion"] == api[d["kind"]], d["metadata"]["name"]
    pvcs = {d["metadata"]["name"]: d for d in by_kind(docs, "PersistentVolumeClaim")}
    if where == OBJECT_STORAGE:
        assert set(pvcs) == {"minio-data"}
        assert pvcs["minio-data"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    else:
        assert set(pvcs) == {"dpfl-shared", "mlflow-artifacts"}
        shared_mode = pvcs["dpfl-shared"]["spec"]["accessModes"]
        local = where == "overlays/local"
        assert shared_mode == (["ReadWriteOnce"] if local else ["ReadWriteMany"])

    for name, template in pod_templates(docs):
        (obj,) = [d for d in docs if f"{d['kind']}/{d['metadata']['name']}" == name]
        labels = template["metadata"]["labels"]
        if obj["kind"] != "Job":  # a Job's selector is generated
            selector = obj["spec"]["selector"]["matchLabels"]
            assert selector.items() <= labels.items(), name
        pod = template["spec"]
        claim_templates = {
            t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])
        }
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs, (name, v)
        for c in pod["containers"]:
            assert c.get("image"), (name, c["name"])
            res = c.get("resources", {})
            assert res.get("requests") and res.get("limits"), (name, c["name"])
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes or m["name"] in claim_templates, (name, m)
            # Secrets only through secretKeyRef of the documented Secret (envFrom would hide
            # which variables hold secret values).
            assert not any("secretRef" in ref for ref in c.get("envFrom", [])), (name, c["name"])
            for ref in secret_refs(c).values():
                assert (ref["name"], ref["key"]) in DOCUMENTED_SECRETS, (name, ref)

    # Every Service selects the pods of a Deployment/StatefulSet and targets a named port.
    for svc in by_kind(docs, "Service"):
        sel = svc["spec"]["selector"]
        matches = [
            t for _, t in pod_templates(docs) if sel.items() <= t["metadata"]["labels"].items()
        ]
        assert len(matches) == 1, svc["metadata"]["name"]
        ports = {
            p["name"]: p["containerPort"]
            for c in matches[0]["spec"]["containers"]
            for p in c["ports"]
        }
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, (svc["metadata"]["name"], p)
    (pg,) = by_kind(docs, "StatefulSet")
    (pg_svc,) = [
        s for s in by_kind(docs, "Service") if s["metadata"]["name"] == pg["spec"]["serviceName"]
    ]
    assert pg_svc["spec"]["clusterIP"] == "None"
    assert pg["spec"]["template"]["spec"]["containers"][0]["image"].startswith("postgres:16")
    assert pg["spec"]["volumeClaimTemplates"]


def test_readme_documents_the_secret():
    assert DOCUMENTED_SECRET, "k8s/README.md: no `kubectl create secret generic ...` command"
    assert DOCUMENTED_SECRET.groups() == ("dpfl-postgres", "POSTGRES_PASSWORD")
    assert {("dpfl-postgres", "POSTGRES_PASSWORD")} | {
        ("dpfl-s3", key) for key in S3_KEYS
    } == DOCUMENTED_SECRETS


@needs_kubectl
def test_mlflow_reads_the_password_from_the_environment(rendered):
    where, docs = rendered
    (mlflow,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "mlflow"]
    (c,) = mlflow["spec"]["template"]["spec"]["containers"]
    argv = c.get("command", []) + c.get("args", [])
    assert argv[:2] == ["mlflow", "server"]
    uri = urllib.parse.urlsplit(argv[argv.index("--backend-store-uri") + 1])
    assert uri.scheme == "postgresql+psycopg"  # psycopg 3, as tests/test_mlflow_postgres
    assert uri.password is None and "$(" not in uri.geturl(), "a password in the URI"
    assert (uri.hostname, uri.port) == ("postgres", 5432)
    # libpq reads PGPASSWORD; PostgreSQL sets its password from POSTGRES_PASSWORD: one Secret.
    # With object storage MLflow also holds the S3 keys (it stores the artifacts).
    assert secret_refs(c) == {
        "PGPASSWORD": {"name": DOCUMENTED_SECRET[1], "key": DOCUMENTED_SECRET[2]}
    } | (s3_key_refs() if where == OBJECT_STORAGE else {})
    (pg,) = by_kind(docs, "StatefulSet")
    (pg_c,) = pg["spec"]["template"]["spec"]["containers"]
    assert secret_refs(pg_c) == {
        "POSTGRES_PASSWORD": {"name": DOCUMENTED_SECRET[1], "key": DOCUMENTED_SECRET[2]}
    }
    pg_env = env_values(pg_c)
    assert uri.username == pg_env["POSTGRES_USER"] and uri.path == "/" + pg_env["POSTGRES_DB"]

    assert "--serve-artifacts" in argv
    dest = argv[argv.index("--artifacts-destination") + 1]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in mlflow["spec"]["template"]["spec"]["volumes"]}
    if where == OBJECT_STORAGE:  # the server's S3 client: boto3, endpoint from this variable
        assert dest == f"s3://{BUCKET}/mlartifacts"
        assert env_values(c)["MLFLOW_S3_ENDPOINT_URL"] == S3_ENDPOINT
        assert env_values(c)["AWS_EC2_METADATA_DISABLED"] == "true"
        assert not any("persistentVolumeClaim" in v for v in vols.values())
    else:
        assert vols[mounts[dest]]["persistentVolumeClaim"]["claimName"] == "mlflow-artifacts"
    assert argv[argv.index("--port") + 1] == "5000"
    (svc,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "mlflow"]
    assert [p["port"] for p in svc["spec"]["ports"]] == [5000]


@needs_kubectl
def test_kubectl_client_dry_run_of_core_objects(rendered):
    _, docs = rendered
    core = [d for d in docs if d["kind"] in CORE_KINDS]
    out = subprocess.run(
        [KUBECTL, "create", "--dry-run=client", "--validate=false", "-o", "yaml", "-f", "-"],
        input=yaml.safe_dump_all(core),
        capture_output=True,
        text=True,
        timeout=20,
    )
    if out.returncode != 0:
        # kubectl needs an API server's discovery data to map kinds, even with --validate=false
        # (kubectl#991, #1589); offline this fails with "connection refused".
        pytest.skip(f"kubectl --dry-run=client needs an API server: {out.stderr.strip()[:200]}")
    assert len([d for d in yaml.safe_load_all(out.stdout) if d]) >= 1


def test_the_private_tmpdir_passes_the_shipped_codes_check(tmp_path, monkeypatch):
    """An emptyDir is mode 0777 with no sticky bit (02777 with an fsGroup): the workers'
    package directory there was refused (any local user could rename it), and every actor of
    a run by address failed to start. The initContainer's command makes TMPDIR private in it,
    which the check accepts."""
    from actors import code_bootstrap

    emptydir = tmp_path / "tmp"
    emptydir.mkdir()
    emptydir.chmod(0o2777)
    monkeypatch.setattr(code_bootstrap.tempfile, "gettempdir", lambda: str(emptydir))
    with pytest.raises(PermissionError, match="set TMPDIR to a private directory"):
        code_bootstrap.unpack_root()
    command = PRIVATE_TMP_COMMAND[2].replace(PRIVATE_TMP, str(emptydir / "dpfl"))
    subprocess.run(["sh", "-c", command], check=True, timeout=30)
    monkeypatch.setattr(code_bootstrap.tempfile, "gettempdir", lambda: str(emptydir / "dpfl"))
    assert code_bootstrap.unpack_root() == emptydir / "dpfl" / f"dpfl-code-{os.getuid()}"
