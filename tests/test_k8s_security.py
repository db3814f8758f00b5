"""The hardening (issue 29) of every container: unprivileged with a securityContext, images' fixed
non-root users, Ray token authentication, no Secret or password in the manifests or on a
command line, and the README's account of it.
"""

from __future__ import annotations

import re

from tests.fixtures_k8s import (
    K8S,
    MINIO_IMAGE,
    MLFLOW_CLIENT_LABEL,
    OBJECT_STORAGE,
    README,
    S3_CLIENT_LABEL,
    SUBMITTER_LABEL,
    all_pods,
    by_kind,
    containers_of,
    env_values,
    needs_kubectl,
    ray_cluster_specs,
    ray_pod_specs,
    secret_refs,
)


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
