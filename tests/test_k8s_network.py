"""The NetworkPolicies: well-formed (networking.k8s.io/v1, unknown fields rejected), and evaluated
on a model of the pods KubeRay creates and of pods around them (who may reach the Ray pods, the
heads' job and client ports, MLflow, PostgreSQL and the object-storage overlay's MinIO).
"""

from __future__ import annotations

import copy

import pytest

from tests.fixtures_k8s import (
    MLFLOW_CLIENT_LABEL,
    S3_CLIENT_LABEL,
    SUBMITTER_LABEL,
    by_kind,
    needs_kubectl,
    pod_templates,
    ray_cluster_specs,
    ray_pod_specs,
    schema_errors,
)

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
