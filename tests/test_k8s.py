"""Offline checks of the Kubernetes deployment in k8s/ (KubeRay + MLflow on PostgreSQL).

Nothing here talks to a cluster: manifests are rendered with `kubectl kustomize`, the RayCluster
and RayJob objects are validated against the KubeRay v1.7.0 CRD schemas (shared/kuberay-crds)
with unknown fields treated as errors, and the core objects are checked structurally.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
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
EXPECTED_KINDS = sorted(
    [
        ("v1", "Secret"),
        ("v1", "Service"),
        ("v1", "Service"),
        ("v1", "PersistentVolumeClaim"),
        ("v1", "PersistentVolumeClaim"),
        ("apps/v1", "Deployment"),
        ("apps/v1", "StatefulSet"),
        ("ray.io/v1", "RayCluster"),
        ("ray.io/v1", "RayJob"),
    ]
)
CORE_KINDS = {"Secret", "Service", "PersistentVolumeClaim", "Deployment", "StatefulSet"}

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH: cannot render")
needs_crds = pytest.mark.skipif(
    not CRDS.is_dir(), reason=f"KubeRay CRD schemas not found at {CRDS}"
)


# ---------------------------------------------------------------- rendering


@pytest.fixture(scope="module", params=["base", "overlays/local"])
def rendered(request) -> tuple[str, list[dict]]:
    if KUBECTL is None:
        pytest.skip("kubectl not on PATH: cannot render the kustomizations")
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / request.param)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    return request.param, docs


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


@needs_kubectl
def test_render_has_exactly_the_expected_kinds(rendered):
    _, docs = rendered
    assert sorted((d["apiVersion"], d["kind"]) for d in docs) == EXPECTED_KINDS
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
        for group, pod in ray_pod_specs(spec):
            claims = {
                v["name"]: v["persistentVolumeClaim"]["claimName"]
                for v in pod["volumes"]
                if "persistentVolumeClaim" in v
            }
            for c in pod["containers"]:
                env = {e["name"]: e.get("value") for e in c["env"]}
                assert {k: env.get(k) for k in RAY_ENV} == RAY_ENV, (name, group)
                assert c["image"].startswith("dpfl-cluster:"), (name, group)
                assert c["resources"]["limits"]["cpu"], (name, group)
                mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
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
        if d["kind"] in {"Deployment", "StatefulSet"}
    ]


@needs_kubectl
def test_core_objects_structure(rendered):
    where, docs = rendered
    api = {
        "Secret": "v1",
        "Service": "v1",
        "PersistentVolumeClaim": "v1",
        "Deployment": "apps/v1",
        "StatefulSet": "apps/v1",
    }
    core = [d for d in docs if d["kind"] in CORE_KINDS]
    for d in core:
        assert d["apiVersion"] == api[d["kind"]], d["metadata"]["name"]
    pvcs = {d["metadata"]["name"]: d for d in by_kind(docs, "PersistentVolumeClaim")}
    assert set(pvcs) == {"dpfl-shared", "mlflow-artifacts"}
    shared_mode = pvcs["dpfl-shared"]["spec"]["accessModes"]
    assert shared_mode == (["ReadWriteOnce"] if where == "overlays/local" else ["ReadWriteMany"])
    secrets = {d["metadata"]["name"]: d for d in by_kind(docs, "Secret")}

    for name, template in pod_templates(docs):
        (obj,) = [d for d in docs if f"{d['kind']}/{d['metadata']['name']}" == name]
        selector = obj["spec"]["selector"]["matchLabels"]
        labels = template["metadata"]["labels"]
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
            refs = [e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if "valueFrom" in e]
            refs = [r for r in refs if r]
            for r in refs:
                assert r["key"] in secrets[r["name"]]["stringData"], (name, r)
            for ref in c.get("envFrom", []):
                assert ref["secretRef"]["name"] in secrets, (name, ref)

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


@needs_kubectl
def test_mlflow_server_uses_postgres_and_the_secret(rendered):
    _, docs = rendered
    (mlflow,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "mlflow"]
    (c,) = mlflow["spec"]["template"]["spec"]["containers"]
    argv = c.get("command", []) + c.get("args", [])
    assert argv[:2] == ["mlflow", "server"]
    uri = argv[argv.index("--backend-store-uri") + 1]
    assert uri.startswith("postgresql+psycopg://")  # psycopg 3, as tests/test_mlflow_postgres
    assert "@postgres:5432/" in uri
    (secret,) = by_kind(docs, "Secret")
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    for var in re.findall(r"\$\((\w+)\)", uri):
        assert env[var]["name"] == secret["metadata"]["name"], var
    assert {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"} <= set(
        re.findall(r"\$\((\w+)\)", uri)
    )
    assert "--serve-artifacts" in argv
    dest = argv[argv.index("--artifacts-destination") + 1]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in mlflow["spec"]["template"]["spec"]["volumes"]}
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
