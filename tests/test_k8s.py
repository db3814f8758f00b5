"""Offline checks of the Kubernetes deployment in k8s/ (KubeRay + MLflow on PostgreSQL).

Nothing here talks to a cluster: every layout (the base and each overlay under k8s/overlays/,
found by listing the folder) is rendered with `kubectl kustomize`, the RayCluster and RayJob
objects are validated against the KubeRay v1.7.0 CRD schemas (shared/kuberay-crds) with unknown
fields treated as errors, and the core objects are checked structurally. The hardening (issue
29) is checked on the rendered manifests: no Secret or password in them, Ray token
authentication, a securityContext on every container, images pinned by exact tag (and
k8s/pin-digests.sh), and the NetworkPolicies evaluated on a model of the pods KubeRay creates.
The object-storage overlay (issue 31) has no shared volume: every Ray pod reads shards and
writes checkpoints on S3 (a MinIO in the cluster), MLflow stores artifacts there, and the
bucket Job's script is run against a real S3-compatible server (moto, tests/fixtures_s3.py).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
CRDS = REPO.parent / "shared" / "kuberay-crds"
KUBECTL = shutil.which("kubectl")
# The image's container paths, read from k8s/Dockerfile (the manifests must agree with it).
IMAGE_ENV = dict(re.findall(r"\b(APP_HOME|DPFL_\w+)=(\S+)", (K8S / "Dockerfile").read_text()))
APP_HOME = IMAGE_ENV.pop("APP_HOME")  # the image's WORKDIR / PYTHONPATH
RAY_ENV = {"MLFLOW_TRACKING_URI": "http://mlflow:5000", **IMAGE_ENV}
SHARED_MOUNT = os.path.commonpath(list(IMAGE_ENV.values()))  # the dpfl-shared volume
LAYOUTS = ["base"] + sorted(f"overlays/{p.name}" for p in (K8S / "overlays").iterdir())
OBJECT_STORAGE = "overlays/object-storage"
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
# The object-storage overlay: one bucket for shards, checkpoints and MLflow's artifacts on the
# MinIO Service, reached with the keys of the Secret the user creates (k8s/README.md).
BUCKET = "dpfl"
S3_ENDPOINT = "http://minio:9000"
S3_ENV = {
    "DPFL_STORE_ROOT": f"s3://{BUCKET}/shards",
    "DPFL_CHECKPOINT_DIR": f"s3://{BUCKET}/checkpoints",
    "AWS_ENDPOINT_URL": S3_ENDPOINT,
    "AWS_EC2_METADATA_DISABLED": "true",
}
S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
README = (K8S / "README.md").read_text()
# The Secret the user creates: the README's `kubectl create secret generic NAME
# --from-literal=KEY=...` is the contract the manifests' secretKeyRefs must meet.
DOCUMENTED_SECRET = re.search(
    r"kubectl create secret generic (\S+) +\\?\s*--from-literal=(\w+)=", README
)
# Every Secret the README has the user create, with its keys: (name, key) pairs.
DOCUMENTED_SECRETS = {
    (m[1], key)
    for m in re.finditer(
        r"kubectl create secret generic (\S+)((?:\s+\\?\s*--from-literal=\w+=\S+)+)", README
    )
    for key in re.findall(r"--from-literal=(\w+)=", m[2])
}
# Labels that admit a pod through the NetworkPolicies (documented in k8s/README.md).
SUBMITTER_LABEL = {"dpfl/ray-submitter": "true"}
MLFLOW_CLIENT_LABEL = {"dpfl/mlflow-client": "true"}
S3_CLIENT_LABEL = {"dpfl/s3-client": "true"}

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH: cannot render")
needs_crds = pytest.mark.skipif(
    not CRDS.is_dir(), reason=f"KubeRay CRD schemas not found at {CRDS}"
)


# ---------------------------------------------------------------- rendering


@pytest.fixture(scope="module", params=LAYOUTS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / request.param)


def render(layout: Path) -> list[dict]:
    if KUBECTL is None:
        pytest.skip("kubectl not on PATH: cannot render the kustomizations")
    out = subprocess.run(
        [KUBECTL, "kustomize", str(layout)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def ray_cluster_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    specs = [
        (f"RayCluster/{d['metadata']['name']}", d["spec"]) for d in by_kind(docs, "RayCluster")
    ]
    for job in by_kind(docs, "RayJob"):
        specs.append((f"RayJob/{job['metadata']['name']}", job["spec"]["rayClusterSpec"]))
    return specs


def ray_pod_specs(cluster_spec: dict) -> list[tuple[str, dict]]:
    pods = [("head", cluster_spec["headGroupSpec"]["template"]["spec"])]
    pods += [(g["groupName"], g["template"]["spec"]) for g in cluster_spec["workerGroupSpecs"]]
    return pods


def test_every_layout_is_known():
    """A new overlay is rendered and validated like the others once it has its expected kinds."""
    assert set(LAYOUTS) == set(EXPECTED_KINDS), "add the new layout to EXPECTED_KINDS"


@needs_kubectl
def test_render_has_exactly_the_expected_kinds(rendered):
    where, docs = rendered
    assert sorted((d["apiVersion"], d["kind"]) for d in docs) == EXPECTED_KINDS[where]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert len(names) == len(docs), "duplicate object names"


# ---------------------------------------------------------------- CRD schema validation


def strict_schema(schema):
    """A CRD openAPIV3Schema as JSON Schema that rejects unknown fields."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _load_validator(crd_file: str):
    import jsonschema

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 1-2 MB of YAML
    crd = yaml.load((CRDS / crd_file).read_text(), Loader=loader)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict_schema(v1["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def validators():
    if not CRDS.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {CRDS}")
    return {
        "RayCluster": _load_validator("ray.io_rayclusters.yaml"),
        "RayJob": _load_validator("ray.io_rayjobs.yaml"),
    }


def schema_errors(validator, obj) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]


def test_strict_schema_transform():
    schema = strict_schema(
        {
            "type": "object",
            "properties": {
                "a": {"x-kubernetes-int-or-string": True},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "map": {"type": "object", "additionalProperties": {"type": "string"}},
                "sub": {"type": "object", "properties": {"b": {"type": "string"}}},
            },
        }
    )
    assert schema["additionalProperties"] is False
    assert schema["properties"]["a"] == {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    assert "additionalProperties" not in schema["properties"]["free"]
    assert schema["properties"]["map"]["additionalProperties"] == {"type": "string"}
    assert schema["properties"]["sub"]["additionalProperties"] is False


@needs_kubectl
@needs_crds
def test_ray_objects_match_kuberay_crds(rendered, validators):
    where, docs = rendered
    ray_objects = by_kind(docs, "RayCluster") + by_kind(docs, "RayJob")
    assert len(ray_objects) == 2
    for obj in ray_objects:
        errors = schema_errors(validators[obj["kind"]], obj)
        assert not errors, f"{where}: {obj['kind']}/{obj['metadata']['name']}: {errors}"


@needs_kubectl
@needs_crds
def test_crd_validation_rejects_typos_and_wrong_types(rendered, validators):
    _, docs = rendered
    (cluster,) = by_kind(docs, "RayCluster")
    validator = validators["RayCluster"]
    assert not schema_errors(validator, cluster)

    typo = copy.deepcopy(cluster)
    typo["spec"]["enableInTreeAutoscalng"] = typo["spec"].pop("enableInTreeAutoscaling")
    assert any("enableInTreeAutoscalng" in e for e in schema_errors(validator, typo))

    nested_typo = copy.deepcopy(cluster)
    nested_typo["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert schema_errors(validator, nested_typo)

    wrong_type = copy.deepcopy(cluster)
    wrong_type["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
    assert any("num-cpus" in e for e in schema_errors(validator, wrong_type))

    wrong_type = copy.deepcopy(cluster)
    wrong_type["spec"]["workerGroupSpecs"][0]["replicas"] = "one"
    assert schema_errors(validator, wrong_type)

    (job,) = by_kind(docs, "RayJob")
    bad_auth = copy.deepcopy(cluster)
    bad_auth["spec"]["authOptions"] = {"mode": "Token"}  # the enum is disabled | token
    assert any("authOptions" in e for e in schema_errors(validator, bad_auth))
    bad_auth["spec"]["authOptions"] = {"mode": "token", "secret": "x"}  # secretName
    assert any("authOptions" in e for e in schema_errors(validator, bad_auth))

    bad_job = copy.deepcopy(job)
    bad_job["spec"]["shutdownAfterJobFinishes"] = "yes"
    bad_job["spec"]["ttlSecondAfterFinished"] = 60
    assert len(schema_errors(validators["RayJob"], bad_job)) >= 2


# ---------------------------------------------------------------- Ray objects, semantically


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
            for c in pod["containers"]:
                env = {e["name"]: e.get("value") for e in c["env"]}
                assert {k: env.get(k) for k in expected_env} == expected_env, (name, group)
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


# ---------------------------------------------------------------- core objects


def pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    return [
        (f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"])
        for d in docs
        if d["kind"] in {"Deployment", "StatefulSet", "Job"}
    ]


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


def secret_refs(container: dict) -> dict[str, dict]:
    """The container's env variables that hold a Secret's value: name -> secretKeyRef."""
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container.get("env", [])
        if e.get("valueFrom", {}).get("secretKeyRef")
    }


def env_values(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def s3_key_refs() -> dict[str, dict]:
    """The S3 keys as a container holds them: each from the documented Secret dpfl-s3."""
    return {key: {"name": "dpfl-s3", "key": key} for key in S3_KEYS}


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


# ---------------------------------------------------------------- image


def locked_version(package: str) -> str:
    lock = (REPO / "uv.lock").read_text()
    m = re.search(
        rf'^\[\[package\]\]\nname = "{re.escape(package)}"\nversion = "([^"]+)"', lock, re.M
    )
    assert m, f"{package} not in uv.lock"
    return m.group(1)


def test_dockerfile_installs_from_the_lock_on_the_matching_ray_image():
    text = (K8S / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)  # join continuation lines
    runs = [line for line in logical.splitlines() if line.strip().startswith("RUN")]
    installs = [r for r in runs if re.search(r"uv (sync|export|pip install)|pip install", r)]
    assert installs, "no dependency install step"
    for r in installs:
        assert re.search(r"uv sync .*--(frozen|locked)|uv export .*--(frozen|locked)", r), r
        assert "--no-dev" in r, r
    assert "COPY pyproject.toml uv.lock" in text

    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    base = base.split("@")[0]  # k8s/pin-digests.sh pins RAY_TAG as <tag>@sha256:...
    ray = locked_version("ray")
    assert base == f"rayproject/ray:{ray}-py311", base
    requires = re.search(r'requires-python = "([^"]+)"', (REPO / "pyproject.toml").read_text())
    assert "3.11" in requires.group(1)
    for folder in ["cluster", "actors", "algorithms", "privacy", "datasets", "models", "configs"]:
        assert re.search(rf"^COPY .*\b{folder}/ {folder}/", text, re.M), folder
        assert (REPO / folder).is_dir(), folder
    assert re.search(r"^ENV PYTHONPATH=", text, re.M)
    assert "compileall" in text

    mlflow = (K8S / "Dockerfile.mlflow").read_text()
    assert f"mlflow:v{locked_version('mlflow')}" in mlflow
    # MLflow's S3 artifact store (the object-storage overlay) needs boto3: the locked one.
    assert re.search(rf'^RUN pip install .*"boto3=={locked_version("boto3")}"', mlflow, re.M)


# ---------------------------------------------------------------- hardening (issue 29)


def containers_of(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def all_pods(docs: list[dict]) -> list[tuple[str, dict, list[dict]]]:
    """(where, pod spec, containers) of every pod the manifests create, KubeRay's included.

    KubeRay adds the autoscaler sidecar to an autoscaling head (from autoscalerOptions) and runs
    the RayJob's submitter from submitterPodTemplate; its other injected container (the workers'
    wait-gcs-ready init container) copies the Ray container's securityContext.
    """
    pods = [(name, t["spec"], containers_of(t["spec"])) for name, t in pod_templates(docs)]
    for name, spec in ray_cluster_specs(docs):
        for group, pod in ray_pod_specs(spec):
            cs = containers_of(pod)
            if group == "head" and spec.get("enableInTreeAutoscaling"):
                opts = spec.get("autoscalerOptions", {})
                cs = cs + [{"name": "autoscaler", "image": pod["containers"][0]["image"], **opts}]
            pods.append((f"{name}/{group}", pod, cs))
    for job in by_kind(docs, "RayJob"):
        tpl = job["spec"].get("submitterPodTemplate")
        assert tpl, "no submitterPodTemplate: KubeRay's default submitter runs unconstrained"
        pods.append(
            (f"RayJob/{job['metadata']['name']}/submitter", tpl["spec"], tpl["spec"]["containers"])
        )
    return pods


MINIO_IMAGE = "quay.io/minio/minio"


def dockerfile_user(name: str) -> tuple[int, int]:
    users = re.findall(r"^USER (\S+)", (K8S / name).read_text(), re.M)
    assert users, f"k8s/{name} sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and gid.isdigit(), f"k8s/{name}: USER {users[-1]} is not numeric"
    return int(uid), int(gid)


def image_user(image: str) -> tuple[int, int]:
    if image.startswith("dpfl-cluster:"):
        return dockerfile_user("Dockerfile")
    if image.startswith("dpfl-mlflow:"):
        return dockerfile_user("Dockerfile.mlflow")
    if image.startswith("postgres:"):
        assert "alpine" not in image, image  # postgres is uid 70 there
        return 999, 999  # the official Debian-based image's postgres user
    if image.startswith(MINIO_IMAGE + ":"):
        return 10002, 10002  # the image has no user of its own (root): the overlay's choice
    raise AssertionError(f"no known user for image {image}")


@needs_kubectl
def test_every_container_runs_unprivileged(rendered):
    where, docs = rendered
    pods = all_pods(docs)
    # postgres, mlflow, 2 x (head, cpu, gpu), the submitter (+ MinIO and the bucket Job)
    assert len(pods) == (11 if where == OBJECT_STORAGE else 9)
    for where, pod, containers in pods:
        pod_ctx = pod.get("securityContext", {})
        assert pod_ctx.get("runAsNonRoot") is True, where
        assert pod_ctx.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        if "fsGroup" in pod_ctx:  # applied once, not re-applied to every file at each start
            assert pod_ctx.get("fsGroupChangePolicy") == "OnRootMismatch", where
        if not where.endswith("/head"):  # only the heads' autoscaler calls the Kubernetes API
            assert pod.get("automountServiceAccountToken") is False, where
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in containers:
            name = (where, c["name"])
            ctx = c.get("securityContext") or {}
            assert ctx.get("runAsNonRoot") is True, name
            assert ctx.get("allowPrivilegeEscalation") is False, name
            assert not ctx.get("privileged"), name
            assert ctx.get("capabilities") == {"drop": ["ALL"]}, name  # nothing added back
            assert ctx.get("seccompProfile") == {"type": "RuntimeDefault"}, name
            assert ctx.get("readOnlyRootFilesystem") is True, name
            uid, gid = image_user(c["image"])
            assert (ctx.get("runAsUser"), ctx.get("runAsGroup")) == (uid, gid), name
            assert (pod_ctx.get("runAsUser"), pod_ctx.get("runAsGroup")) == (uid, gid), name
            # The root filesystem is read-only: /tmp (Ray's /tmp/ray) is an emptyDir.
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert "emptyDir" in volumes[mounts["/tmp"]], name
        if "postgres" in where.lower():
            assert pod_ctx.get("fsGroup") == 999, where
            (c,) = containers
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert "emptyDir" in volumes[mounts["/var/run/postgresql"]], where


def test_images_run_as_a_fixed_non_root_user():
    assert dockerfile_user("Dockerfile") == (1000, 100)  # the Ray image's user ray
    uid, gid = dockerfile_user("Dockerfile.mlflow")
    assert uid >= 1000 and gid >= 1000
    mlflow = (K8S / "Dockerfile.mlflow").read_text()
    assert re.search(rf"useradd .*--uid {uid}\b", mlflow.replace("\\\n", " ")), "no such user"


@needs_kubectl
def test_ray_token_authentication(rendered):
    _, docs = rendered
    specs = ray_cluster_specs(docs)
    assert [name.split("/")[0] for name, _ in specs] == ["RayCluster", "RayJob"]
    for name, spec in specs:
        # mode token, no secretName: KubeRay generates the token Secret (named after the
        # cluster, key auth_token) and injects RAY_AUTH_MODE/RAY_AUTH_TOKEN into every Ray
        # container and the submitter. enableK8sTokenAuth is unsupported for RayJobs.
        assert spec.get("authOptions") == {"mode": "token"}, name
        major, minor, _ = map(int, spec["rayVersion"].split("."))
        assert (major, minor) >= (2, 52), name  # KubeRay's minimum for token auth
        for group, pod in ray_pod_specs(spec):
            for c in containers_of(pod):  # nothing may switch it off or fix a token
                names = {e["name"] for e in c.get("env", [])}
                assert not names & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}, (name, group)


SECRET_NAME = re.compile(r"PASSWORD|PASSWD|TOKEN|SECRET|CREDENTIAL", re.I)
URI_WITH_PASSWORD = re.compile(r"://[^/\s:@]+:[^/\s@]+@")


def command_strings(container: dict) -> list[str]:
    """Everything the container's processes get as arguments: command, args, probe commands."""
    out = list(container.get("command", [])) + list(container.get("args", []))
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        out += container.get(probe, {}).get("exec", {}).get("command", [])
    for hook in container.get("lifecycle", {}).values():
        out += hook.get("exec", {}).get("command", [])
    return out


@needs_kubectl
def test_no_password_in_the_manifests_or_on_a_command_line(rendered):
    where, docs = rendered
    assert not by_kind(docs, "Secret"), f"{where}: a Secret with literal values"
    for pod_name, _, containers in all_pods(docs):
        for c in containers:
            name = (where, pod_name, c["name"])
            for var, value in env_values(c).items():
                assert not SECRET_NAME.search(var), (name, var, "a literal value")
                assert not URI_WITH_PASSWORD.search(value), (name, var)
            secret_vars = set(secret_refs(c))
            for arg in command_strings(c):
                assert not URI_WITH_PASSWORD.search(arg), (name, arg)
                assert "password" not in arg.lower(), (name, arg)
                # $(VAR) is expanded by Kubernetes into the process's arguments.
                assert not set(re.findall(r"\$\((\w+)\)", arg)) & secret_vars, (name, arg)


EXACT_TAG = re.compile(
    r"^v?\d+\.\d+(\.\d+)?([-.][A-Za-z0-9.]+)*$"
    r"|^RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ$"  # MinIO's: one build, dated to the second
)
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def check_image_ref(ref: str) -> tuple[str, str]:
    """name:tag[@sha256:...] with an exact version tag; returns (name, tag)."""
    ref, _, digest = ref.partition("@")
    assert not digest or DIGEST.match(digest), ref
    name, sep, tag = ref.rpartition(":")
    assert sep and "/" not in tag, f"{ref}: no tag"
    assert tag != "latest" and EXACT_TAG.match(tag), f"{ref}: not an exact version tag"
    return name, tag


def dockerfile_image_refs(name: str) -> list[str]:
    text = (K8S / name).read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    refs = re.findall(r"^FROM (\S+)", text, re.M) + re.findall(r"^COPY --from=(\S+)", text, re.M)
    return [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], r) for r in refs]


@needs_kubectl
def test_images_are_pinned_by_exact_tags(rendered):
    where, docs = rendered
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    own = {
        "dpfl-cluster": {version[1], version[1] + "-gpu"},
        "dpfl-mlflow": {locked_version("mlflow")},
    }
    seen = set()
    for pod_name, _, containers in all_pods(docs):
        for c in containers:
            name, tag = check_image_ref(c["image"])
            seen.add(name)
            if name in own:
                assert tag in own[name], (pod_name, c["image"])
    minio = {MINIO_IMAGE} if where == OBJECT_STORAGE else set()
    assert seen == {"dpfl-cluster", "dpfl-mlflow", "postgres"} | minio
    bases = dockerfile_image_refs("Dockerfile") + dockerfile_image_refs("Dockerfile.mlflow")
    assert len(bases) == 3  # rayproject/ray, uv, mlflow
    for ref in bases:
        check_image_ref(ref)


def test_image_ref_check_rejects_floating_tags():
    for bad in ["postgres:16", "postgres", "dpfl-cluster:latest", "x:latest-gpu", "r:5000/x"] + [
        "minio/minio:RELEASE.2025-09-07",
        "minio/minio:RELEASE.latest",
        "minio/minio:release.2025-09-07T16-13-09Z",
    ]:
        with pytest.raises(AssertionError):
            check_image_ref(bad)
    for good in [
        "postgres:16.10-bookworm",
        "rayproject/ray:2.60.0-py311",
        "a/b:v3.17.2",
        "quay.io/minio/minio:RELEASE.2025-09-07T16-13-09Z",
    ]:
        check_image_ref(good)
        check_image_ref(good + "@sha256:" + "0" * 64)
    with pytest.raises(AssertionError):
        check_image_ref("postgres:16.10@sha256:abc")


# ---------------------------------------------------------------- NetworkPolicies

NP_PEER = {
    "type": "object",
    "additionalProperties": False,
    "minProperties": 1,
    "properties": {
        "podSelector": {"$ref": "#/definitions/selector"},
        "namespaceSelector": {"$ref": "#/definitions/selector"},
        "ipBlock": {
            "type": "object",
            "additionalProperties": False,
            "required": ["cidr"],
            "properties": {
                "cidr": {"type": "string"},
                "except": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}
NP_PORT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
        "port": {
            "anyOf": [{"type": "integer", "minimum": 1, "maximum": 65535}, {"type": "string"}]
        },
        "endPort": {"type": "integer"},
    },
}
NP_RULE = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"ports": {"type": "array", "items": NP_PORT}},
}
# networking.k8s.io/v1 NetworkPolicy, the fields the API defines, unknown ones rejected (no core
# schema is vendored here).
NETWORK_POLICY_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "definitions": {
        "selector": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                "matchExpressions": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["key", "operator"],
                        "properties": {
                            "key": {"type": "string"},
                            "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                            "values": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                },
            },
        }
    },
    "properties": {
        "apiVersion": {"const": "networking.k8s.io/v1"},
        "kind": {"const": "NetworkPolicy"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["podSelector"],
            "properties": {
                "podSelector": {"$ref": "#/definitions/selector"},
                "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
                "ingress": {
                    "type": "array",
                    "items": {
                        **NP_RULE,
                        "properties": {
                            **NP_RULE["properties"],
                            "from": {"type": "array", "items": NP_PEER},
                        },
                    },
                },
                "egress": {
                    "type": "array",
                    "items": {
                        **NP_RULE,
                        "properties": {
                            **NP_RULE["properties"],
                            "to": {"type": "array", "items": NP_PEER},
                        },
                    },
                },
            },
        },
    },
}


@needs_kubectl
def test_network_policies_are_well_formed(rendered):
    import jsonschema

    where, docs = rendered
    jsonschema.Draft7Validator.check_schema(NETWORK_POLICY_SCHEMA)
    validator = jsonschema.Draft7Validator(NETWORK_POLICY_SCHEMA)
    policies = by_kind(docs, "NetworkPolicy")
    for p in policies:
        assert not schema_errors(validator, p), (where, p["metadata"]["name"])
        assert p["spec"].get("policyTypes") == ["Ingress"], p["metadata"]["name"]
        for rule in p["spec"]["ingress"]:
            assert rule.get("from"), p["metadata"]["name"]  # never "from anywhere"
            for peer in rule["from"]:
                assert "ipBlock" not in peer and "podSelector" in peer, p["metadata"]["name"]
    bad = copy.deepcopy(policies[0])
    bad["spec"]["ingress"][0]["form"] = bad["spec"]["ingress"][0].pop("from")
    assert schema_errors(validator, bad)
    bad = copy.deepcopy(policies[0])
    bad["spec"]["podSelector"] = {"matchLabel": {"a": "b"}}
    assert schema_errors(validator, bad)


# A model of NetworkPolicy ingress semantics (kubernetes.io/docs/concepts/services-networking/
# network-policies): a pod selected by no Ingress policy admits everything; a selected pod
# admits what any rule of any policy selecting it admits. A rule with no ports admits every port.
ALL_PORTS = "all ports"
NAMESPACE = "dpfl"  # the namespace the kustomization is applied in


class Pod:
    def __init__(self, name: str, labels: dict, namespace: str = NAMESPACE, ports=None):
        self.name, self.labels, self.namespace = name, labels, namespace
        self.ns_labels = {"kubernetes.io/metadata.name": namespace}
        self.ports = ports or {}  # container port names -> numbers

    def __repr__(self):
        return self.name


def selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and key in labels and labels[key] in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def peer_matches(peer: dict, src: Pod, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return False
    ns_sel = peer.get("namespaceSelector")
    in_ns = (
        selects(ns_sel, src.ns_labels) if ns_sel is not None else src.namespace == policy_namespace
    )
    return in_ns and selects(peer.get("podSelector", {}), src.labels)


def ports_match(rule_ports, port, dst: Pod) -> bool:
    if not rule_ports:
        return True
    if port == ALL_PORTS:
        return False
    for p in rule_ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in p:
            return True
        first = dst.ports.get(p["port"]) if isinstance(p["port"], str) else p["port"]
        if first is not None and first <= port <= p.get("endPort", first):
            return True
    return False


def admits(policies: list[dict], dst: Pod, port, src: Pod) -> bool:
    selecting = [
        p
        for p in policies
        if dst.namespace == NAMESPACE
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], dst.labels)
    ]
    if not selecting:
        return True
    return any(
        (not rule.get("from") or any(peer_matches(peer, src, NAMESPACE) for peer in rule["from"]))
        and ports_match(rule.get("ports"), port, dst)
        for p in selecting
        for rule in p["spec"].get("ingress") or []
    )


def kuberay_pod_labels(template_labels: dict, cluster: str, node_type: str, group: str) -> dict:
    """The labels KubeRay v1.7.0 gives a Ray pod (common/pod.go labelPod): its own, then the
    template's, except that ray.io/cluster, ray.io/node-type and ray.io/group stay its own."""
    labels = {
        "ray.io/is-ray-node": "yes",
        "ray.io/cluster": cluster,
        "ray.io/node-type": node_type,
        "ray.io/group": group,
        "ray.io/identifier": f"{cluster}-{node_type}",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    protected = {"ray.io/cluster", "ray.io/node-type", "ray.io/group"}
    labels.update({k: v for k, v in template_labels.items() if k not in protected})
    return labels


def model_pods(docs: list[dict]) -> dict:
    """The pods of a deployment of these manifests, and pods around them."""
    clusters = {}
    for name, spec in ray_cluster_specs(docs):
        kind, cr = name.split("/")
        # A RayJob's cluster gets a random name (<rayjob>-<5 random characters>).
        cluster = cr if kind == "RayCluster" else f"{cr}-q7x2k"
        pods = []
        for group, pod in ray_pod_specs(spec):
            tpl = (
                spec["headGroupSpec"]
                if group == "head"
                else next(g for g in spec["workerGroupSpecs"] if g["groupName"] == group)
            )["template"]
            labels = kuberay_pod_labels(
                tpl.get("metadata", {}).get("labels", {}),
                cluster,
                "head" if group == "head" else "worker",
                "headgroup" if group == "head" else group,
            )
            ports = {p["name"]: p["containerPort"] for p in pod["containers"][0].get("ports", [])}
            pods.append(Pod(f"{cr}/{group}", labels, ports=ports))
        clusters[kind] = pods
    (job,) = by_kind(docs, "RayJob")
    submitter_labels = {
        **job["spec"].get("submitterPodTemplate", {}).get("metadata", {}).get("labels", {}),
        "ray.io/originated-from-cr-name": job["metadata"]["name"],
        "ray.io/originated-from-crd": "RayJob",
        "app.kubernetes.io/created-by": "kuberay-operator",
        "batch.kubernetes.io/job-name": job["metadata"]["name"],
    }
    workloads = {
        name.split("/")[1]: Pod(name, t["metadata"]["labels"]) for name, t in pod_templates(docs)
    }
    return {
        **workloads,  # mlflow, postgres (and minio, dpfl-bucket)
        "cluster": clusters["RayCluster"],
        "job_cluster": clusters["RayJob"],
        "job_submitter": Pod("job-submitter", submitter_labels),
        "submitter": Pod("labelled-submitter", dict(SUBMITTER_LABEL)),
        "mlflow_client": Pod("labelled-mlflow-client", dict(MLFLOW_CLIENT_LABEL)),
        "stranger": Pod("stranger", {"app": "notebook"}),
        "unlabelled": Pod("unlabelled", {}),
        "foreign_submitter": Pod("foreign-submitter", dict(SUBMITTER_LABEL), "elsewhere"),
        "foreign_client": Pod("foreign-mlflow-client", dict(MLFLOW_CLIENT_LABEL), "elsewhere"),
        "s3_client": Pod("labelled-s3-client", dict(S3_CLIENT_LABEL)),
        "foreign_s3_client": Pod("foreign-s3-client", dict(S3_CLIENT_LABEL), "elsewhere"),
        "operator": Pod(
            "kuberay-operator",
            {
                "app.kubernetes.io/name": "kuberay-operator",
                "app.kubernetes.io/instance": "kuberay-operator",
                "app.kubernetes.io/component": "kuberay-operator",
            },
            "kuberay-system",
        ),
        "operator_impostor": Pod("impostor", {"app.kubernetes.io/name": "kuberay-operator"}),
    }


RAY_PORTS = [6379, 8265, 10001, 8080, 52365, 45678, 65535]  # GCS, dashboard, client, others


@pytest.fixture
def network(rendered):
    _, docs = rendered
    return by_kind(docs, "NetworkPolicy"), model_pods(docs)


@needs_kubectl
def test_ray_pods_admit_all_ports_from_their_own_cluster_only(network):
    policies, pods = network
    for mine, other in [("cluster", "job_cluster"), ("job_cluster", "cluster")]:
        assert len(pods[mine]) == 3  # head, cpu, gpu
        for dst in pods[mine]:
            for src in pods[mine]:
                assert admits(policies, dst, ALL_PORTS, src), (src, dst)
            outsiders = pods[other] + [
                pods[k] for k in ["stranger", "unlabelled", "mlflow", "postgres", "mlflow_client"]
            ]
            for src in outsiders:
                for port in RAY_PORTS:
                    assert not admits(policies, dst, port, src), (src, dst, port)
    for dst in pods["cluster"][1:] + pods["job_cluster"][1:]:  # workers: nobody from outside
        for key in ["submitter", "job_submitter", "operator", "foreign_submitter"]:
            for port in RAY_PORTS:
                assert not admits(policies, dst, port, pods[key]), (key, dst, port)


@needs_kubectl
def test_heads_admit_the_job_and_client_ports_only_from_submitters(network):
    policies, pods = network
    head, job_head = pods["cluster"][0], pods["job_cluster"][0]
    assert head.labels["ray.io/node-type"] == job_head.labels["ray.io/node-type"] == "head"
    assert head.ports["dashboard"] == 8265 and head.ports["client"] == 10001
    # The RayCluster's head: labelled submitters on the Jobs API and the Ray client port.
    for port in [8265, 10001]:
        assert admits(policies, head, port, pods["submitter"]), port
    for port in [6379, 8080, 52365, 45678]:
        assert not admits(policies, head, port, pods["submitter"]), port
    # The RayJob's head: its own submitter, on the Jobs API only; no other submitter.
    assert admits(policies, job_head, 8265, pods["job_submitter"])
    for port in [6379, 10001, 45678]:
        assert not admits(policies, job_head, port, pods["job_submitter"]), port
    for port in RAY_PORTS:
        assert not admits(policies, job_head, port, pods["submitter"]), port
        assert not admits(policies, head, port, pods["job_submitter"]), port
    # The KubeRay operator polls both dashboards; a look-alike in our namespace may not.
    for h in [head, job_head]:
        assert admits(policies, h, 8265, pods["operator"]), h
        assert not admits(policies, h, 6379, pods["operator"]), h
        for port in RAY_PORTS:
            assert not admits(policies, h, port, pods["operator_impostor"]), (h, port)
            assert not admits(policies, h, port, pods["foreign_submitter"]), (h, port)


@needs_kubectl
def test_mlflow_admits_ray_pods_and_labelled_clients_and_postgres_only_mlflow(network):
    policies, pods = network
    mlflow, postgres = pods["mlflow"], pods["postgres"]
    ray_pods = pods["cluster"] + pods["job_cluster"]
    for src in ray_pods + [pods["mlflow_client"]]:
        assert admits(policies, mlflow, 5000, src), src
        assert not admits(policies, mlflow, 5001, src), src
    for key in ["stranger", "unlabelled", "submitter", "foreign_client", "postgres", "operator"]:
        assert not admits(policies, mlflow, 5000, pods[key]), key
    assert admits(policies, postgres, 5432, mlflow)
    assert not admits(policies, postgres, 22, mlflow)
    for src in ray_pods + [pods[k] for k in ["mlflow_client", "stranger", "unlabelled"]]:
        assert not admits(policies, postgres, 5432, src), src


def test_network_policy_model():
    """The evaluator itself: default allow, additive policies, namespaces, ports."""
    a, b = Pod("a", {"app": "a"}), Pod("b", {"app": "b"})
    far = Pod("far", {"app": "b"}, "elsewhere")
    assert admits([], a, 1, b)
    deny_all = {"spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    assert not admits([deny_all], a, 1, b)
    from_b = {
        "spec": {
            "podSelector": {"matchLabels": {"app": "a"}},
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {"app": "b"}}}], "ports": [{"port": 80}]}
            ],
        }
    }
    assert admits([deny_all, from_b], a, 80, b) and not admits([deny_all, from_b], a, 81, b)
    assert not admits([from_b], a, ALL_PORTS, b) and not admits([from_b], a, 80, far)
    assert not admits([from_b], a, 80, a) and admits([from_b], b, 80, a)  # b not selected
    any_ns = copy.deepcopy(from_b)
    any_ns["spec"]["ingress"][0]["from"][0]["namespaceSelector"] = {}
    assert admits([any_ns], a, 80, far)
    named = copy.deepcopy(from_b)
    named["spec"]["ingress"][0]["ports"] = [{"port": "http"}]
    assert admits([named], Pod("a2", {"app": "a"}, ports={"http": 80}), 80, b)


# ---------------------------------------------------------------- docs and digest pinning


@needs_kubectl
def test_readme_documents_the_hardening(rendered):
    _, docs = rendered
    for label in [SUBMITTER_LABEL, MLFLOW_CLIENT_LABEL, S3_CLIENT_LABEL]:
        ((key, value),) = label.items()
        assert f'{key}: "{value}"' in README or f"{key}={value}" in README, key
    for p in by_kind(docs, "NetworkPolicy"):
        assert p["metadata"]["name"] in README, p["metadata"]["name"]
    for needle in ["RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN", "auth_token", "pin-digests.sh"]:
        assert needle in README, needle


def run_pin_digests(k8s_copy: Path, path_dirs: list[Path], salt: str = ""):
    env = {"PATH": os.pathsep.join(map(str, path_dirs)), "SALT": salt, "LC_ALL": "C"}
    return subprocess.run(
        ["bash", str(k8s_copy / "pin-digests.sh")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_pin_digests_rewrites_tags_to_tag_at_digest(tmp_path):
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s)
    system_bin = sorted({str(Path(shutil.which(t)).parent) for t in ["sed", "awk", "sha256sum"]})
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "crane").write_text(  # a registry: a digest derived from the reference (and SALT)
        '#!/bin/sh\n[ "$1" = digest ] || exit 9\n'
        'printf "sha256:%s\\n" "$(printf "%s%s" "$2" "$SALT" | sha256sum | cut -c1-64)"\n'
    )
    (stub / "crane").chmod(0o755)
    before = {p: p.read_text() for p in k8s.rglob("*") if p.is_file()}

    no_tool = run_pin_digests(k8s, [Path(d) for d in system_bin])
    assert no_tool.returncode != 0 and "crane" in no_tool.stderr
    assert {p: p.read_text() for p in before} == before, "files changed without a resolver"

    def digest(ref, salt=""):
        import hashlib

        return "sha256:" + hashlib.sha256((ref + salt).encode()).hexdigest()

    for salt in ["", "rebuilt"]:  # a second run replaces the digest, never appends one
        out = run_pin_digests(k8s, [stub, *map(Path, system_bin)], salt)
        assert out.returncode == 0, out.stderr
        docker = (k8s / "Dockerfile").read_text()
        ray = f"2.60.0-py311@{digest('rayproject/ray:2.60.0-py311', salt)}"
        assert f"ARG RAY_TAG={ray}\n" in docker
        assert "FROM rayproject/ray:${RAY_TAG}\n" in docker
        uv = "ghcr.io/astral-sh/uv:0.13.9"
        assert f"COPY --from={uv}@{digest(uv, salt)} /uv" in docker
        ml = "ghcr.io/mlflow/mlflow:v3.17.2"
        assert f"FROM {ml}@{digest(ml, salt)}\n" in (k8s / "Dockerfile.mlflow").read_text()
        pg = "postgres:16.10-bookworm"
        assert f"image: {pg}@{digest(pg, salt)}  #" in (k8s / "base/postgres.yaml").read_text()
        assert (
            f"RAY_TAG=2.60.0-py311-gpu@{digest('rayproject/ray:2.60.0-py311-gpu', salt)}"
            in out.stdout
        )
    changed = sorted(str(p.relative_to(k8s)) for p in before if p.read_text() != before[p])
    minio = "overlays/object-storage/minio.yaml"
    assert changed == ["Dockerfile", "Dockerfile.mlflow", "base/postgres.yaml", minio]
    release = f"{MINIO_IMAGE}:RELEASE.2025-09-07T16-13-09Z"
    assert f"image: {release}@{digest(release, 'rebuilt')}\n" in (k8s / minio).read_text()
    # Only the references changed; the pinned manifests still render, their refs still check.
    for p in before:
        old, new = before[p].splitlines(), p.read_text().splitlines()
        for o, n in zip(old, new, strict=True):
            assert o == n or re.sub(r"@sha256:[0-9a-f]{64}", "", n) == o, (p, n)
    if KUBECTL:
        rendered = subprocess.run(
            [KUBECTL, "kustomize", str(k8s / "base")], capture_output=True, text=True, timeout=60
        )
        assert rendered.returncode == 0, rendered.stderr
        images = re.findall(r"image: (\S+)", rendered.stdout)
        assert f"{pg}@{digest(pg, 'rebuilt')}" in images
        for image in images:
            check_image_ref(image)


# ---------------------------------------------------------------- object storage (issue 31)


@pytest.fixture(scope="module")
def object_storage() -> list[dict]:
    return render(K8S / OBJECT_STORAGE)


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
def test_minio_admits_ray_pods_mlflow_and_labelled_s3_clients_only(object_storage):
    policies = by_kind(object_storage, "NetworkPolicy")
    pods = model_pods(object_storage)
    minio, bucket_job = pods["minio"], pods["dpfl-bucket"]
    for src in pods["cluster"] + pods["job_cluster"] + [pods["mlflow"], bucket_job]:
        assert admits(policies, minio, 9000, src), src
        assert not admits(policies, minio, 9001, src), src  # no console
    assert admits(policies, minio, 9000, pods["s3_client"])
    for key in ["stranger", "postgres", "mlflow_client", "submitter", "foreign_s3_client"]:
        assert not admits(policies, minio, 9000, pods[key]), key


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
