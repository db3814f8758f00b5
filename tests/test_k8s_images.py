"""The images: k8s/Dockerfile installs from uv.lock on the matching Ray image, every image is
pinned by an exact tag, and k8s/pin-digests.sh rewrites the tags to tag@digest.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fixtures_k8s import (
    K8S,
    KUBECTL,
    MINIO_IMAGE,
    OBJECT_STORAGE,
    REPO,
    all_pods,
    locked_version,
    needs_kubectl,
)


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
