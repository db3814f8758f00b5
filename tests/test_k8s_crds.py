"""The rendered RayCluster and RayJob objects validated against the KubeRay v1.7.0 CRD schemas
(shared/kuberay-crds), with unknown fields treated as errors.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from tests.fixtures_k8s import (
    REPO,
    by_kind,
    needs_kubectl,
    schema_errors,
)

CRDS = REPO.parent / "shared" / "kuberay-crds"
needs_crds = pytest.mark.skipif(
    not CRDS.is_dir(), reason=f"KubeRay CRD schemas not found at {CRDS}"
)


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
