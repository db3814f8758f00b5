"""The Kubernetes deployment in k8s/ as the test_k8s* modules read it, offline.

Every layout (the base and each overlay under k8s/overlays/, found by listing the folder) is
rendered with `kubectl kustomize` (the ``rendered`` fixture, one per layout; ``object_storage``:
the object-storage overlay alone). Here too: the pods the manifests create (KubeRay's
included), their Secrets and variables, the object-storage overlay's bucket and endpoint, the
Secrets and labels that k8s/README.md documents, and the versions uv.lock pins. Registered as a
plugin in tests/conftest.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
KUBECTL = shutil.which("kubectl")
LAYOUTS = ["base"] + sorted(f"overlays/{p.name}" for p in (K8S / "overlays").iterdir())
OBJECT_STORAGE = "overlays/object-storage"
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
MINIO_IMAGE = "quay.io/minio/minio"


needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl not on PATH: cannot render")


# Rendered once a session for all the test_k8s* modules; tests copy what they alter.
@pytest.fixture(scope="session", params=LAYOUTS)
def rendered(request) -> tuple[str, list[dict]]:
    """(layout, its objects), for each layout."""
    return request.param, render(K8S / request.param)


@pytest.fixture(scope="session")
def object_storage() -> list[dict]:
    """The objects of the object-storage overlay."""
    return render(K8S / OBJECT_STORAGE)


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


def pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    return [
        (f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"])
        for d in docs
        if d["kind"] in {"Deployment", "StatefulSet", "Job"}
    ]


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


def locked_version(package: str) -> str:
    lock = (REPO / "uv.lock").read_text()
    m = re.search(
        rf'^\[\[package\]\]\nname = "{re.escape(package)}"\nversion = "([^"]+)"', lock, re.M
    )
    assert m, f"{package} not in uv.lock"
    return m.group(1)


def schema_errors(validator, obj) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)
    ]
