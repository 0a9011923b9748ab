"""deploy/: every manifest is valid for the Kubernetes version we state, the RayCluster for the
KubeRay release we state, and the security context and settings are what docs/cluster.md says.

Pure and fast (no cluster, no network): the schemas ship with kubernetes-validate and with this
directory (schemas/README.md says where KubeRay's came from). Unknown fields are errors here, as
they are for `kubectl apply` (server-side field validation is Strict by default).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from orchestrator.config import Settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.33.0"
KUBERAY_SCHEMA = Path(__file__).parent / "schemas" / "kuberay-v1.7.0-raycluster-v1.json"


def documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                found.append((f"{path.name}:{document['kind']}", document))
    return found


def one(kind: str) -> dict[str, Any]:
    (document,) = [d for _, d in documents() if d["kind"] == kind]
    return document


def strict(schema: Any) -> Any:
    """The CRD's schema with unknown fields refused, as the API server's Strict validation does
    (a CRD's schema leaves them to pruning, which would drop a misspelt field silently)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def test_every_manifest_is_there() -> None:
    kinds = sorted(name for name, _ in documents())
    assert kinds == [
        "networkpolicy.yaml:NetworkPolicy",
        "networkpolicy.yaml:NetworkPolicy",
        "networkpolicy.yaml:NetworkPolicy",
        "raycluster.yaml:RayCluster",
        "redis.yaml:Service",
        "redis.yaml:StatefulSet",
        "service.yaml:Deployment",
        "service.yaml:Service",
    ]


@pytest.mark.parametrize(
    "name,document",
    [(n, d) for n, d in documents() if d["kind"] != "RayCluster"],
    ids=[n for n, d in documents() if d["kind"] != "RayCluster"],
)
def test_kubernetes_objects_are_valid(name: str, document: dict[str, Any]) -> None:
    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_a_misspelt_field_is_caught() -> None:
    """The check above can fail: the same Deployment with one field misspelt is refused."""
    deployment = one("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["securtyContext"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_raycluster_matches_kuberays_crd() -> None:
    schema = strict(json.loads(KUBERAY_SCHEMA.read_text()))
    cluster = one("RayCluster")
    jsonschema.validate(cluster, schema)
    cluster["spec"]["gcsFaultToleranceOption"] = cluster["spec"].pop("gcsFaultToleranceOptions")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(cluster, schema)


def test_the_raycluster_pod_templates_are_valid_kubernetes_pods() -> None:
    """The CRD's copy of the pod schema may lag behind Kubernetes: check the templates against
    Kubernetes' own too."""
    spec = one("RayCluster")["spec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
        template["template"] = group["template"]
        kubernetes_validate.validate(template, KUBERNETES_VERSION, strict=True)


def test_gcs_fault_tolerance_and_the_store_share_one_redis() -> None:
    ft = one("RayCluster")["spec"]["gcsFaultToleranceOptions"]
    redis_service = next(d for n, d in documents() if n == "redis.yaml:Service")
    host = redis_service["metadata"]["name"]
    assert ft["redisAddress"] == f"{host}:6379"
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"]["name"] == "code-interpreter-redis"
    env = {
        e["name"]: e for e in one("Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["CODE_INTERPRETER_STORE_URL"]["value"] == (
        f"redis://:$(REDIS_PASSWORD)@{host}:6379/1"
    )  # database 1: the GCS keeps database 0


def test_the_workers_offer_sessions_and_the_head_none() -> None:
    spec = one("RayCluster")["spec"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert "resources" not in spec["headGroupSpec"]["rayStartParams"]
    (workers,) = spec["workerGroupSpecs"]
    # KubeRay strips the quotes around the JSON before it hands it to `ray start --resources`.
    resources = json.loads(workers["rayStartParams"]["resources"].strip("'\"` "))
    assert isinstance(resources["cir_sessions"], int) and resources["cir_sessions"] > 0
    (container,) = workers["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["CIR_NODE_BACKEND"] == "local"


def test_the_worker_security_context_is_the_documented_minimum() -> None:
    """What docs/cluster.md states bubblewrap needs, and nothing more."""
    (workers,) = one("RayCluster")["spec"]["workerGroupSpecs"]
    pod = workers["template"]["spec"]
    assert pod["hostUsers"] is False  # Kubernetes allows an unmasked /proc only with it
    assert "securityContext" not in pod or "seccompProfile" not in pod["securityContext"]
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "procMount": "Unmasked",
        "seccompProfile": {"type": "Unconfined"},
        "appArmorProfile": {"type": "Unconfined"},
    }
    docs = (ROOT / "docs" / "cluster.md").read_text()
    for stated in ("`procMount: Unmasked`", "`hostUsers: false`", "`seccompProfile: Unconfined`"):
        assert stated in docs


def test_nothing_else_runs_unconfined() -> None:
    """The head, the replicas and Redis run no sandbox: RuntimeDefault, no capabilities."""
    spec = one("RayCluster")["spec"]
    pods = [
        spec["headGroupSpec"]["template"]["spec"],
        one("Deployment")["spec"]["template"]["spec"],
        one("StatefulSet")["spec"]["template"]["spec"],
    ]
    for pod in pods:
        for container in pod["containers"]:
            context = {**pod.get("securityContext", {}), **container["securityContext"]}
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert context["allowPrivilegeEscalation"] is False
            assert context["runAsNonRoot"] is True
            assert "procMount" not in context and not context.get("privileged")


def test_the_replicas_settings_exist() -> None:
    """Every CODE_INTERPRETER_* variable the replicas get names a setting: a misspelt one would
    be ignored at start without a word (the environment is read by field name)."""
    (container,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    names = [e["name"] for e in container["env"] if e["name"].startswith("CODE_INTERPRETER_")]
    assert names
    for name in names:
        assert name.removeprefix("CODE_INTERPRETER_").lower() in Settings.model_fields, name
    probes = [container["readinessProbe"], container["livenessProbe"]]
    assert {p["httpGet"]["path"] for p in probes} == {"/healthz"}


def test_one_image_and_one_ray_version() -> None:
    images = set()
    spec = one("RayCluster")["spec"]
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        images |= {c["image"] for c in group["template"]["spec"]["containers"]}
    images |= {c["image"] for c in one("Deployment")["spec"]["template"]["spec"]["containers"]}
    assert len(images) == 1
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    pinned = re.search(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    assert pinned is not None and pinned.group(1) == spec["rayVersion"]
    assert "[server,kernel,cluster]" in dockerfile


# --- Ray token authentication and what of Ray is reachable -------------------------------------

RAY_AUTH_SECRET = "code-interpreter-ray-auth"
# KubeRay's RAY_AUTH_TOKEN_SECRET_KEY: the key authOptions.secretName's Secret must hold.
RAY_AUTH_TOKEN_KEY = "auth_token"
RAY_AUTH_ENV = {
    "RAY_AUTH_MODE": {"name": "RAY_AUTH_MODE", "value": "token"},
    "RAY_AUTH_TOKEN": {
        "name": "RAY_AUTH_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": RAY_AUTH_SECRET, "key": RAY_AUTH_TOKEN_KEY}},
    },
}


def ray_pod_containers(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    """The Ray containers as KubeRay runs them: with authOptions.mode token, KubeRay (v1.7.0,
    ray-operator/controllers/ray/common/pod.go, SetContainerTokenAuthEnvVars) adds RAY_AUTH_MODE
    and RAY_AUTH_TOKEN (from secretName's key auth_token, else a Secret named after the cluster)
    to the Ray container of each pod, the first one, unless that container sets them itself."""
    spec = cluster["spec"]
    auth = spec.get("authOptions", {})
    containers = []
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        pod_containers = group["template"]["spec"]["containers"]
        for index, container in enumerate(pod_containers):
            env = [dict(e) for e in container.get("env", [])]
            names = {e["name"] for e in env}
            if index == 0 and auth.get("mode") == "token":
                secret = auth.get("secretName") or cluster["metadata"]["name"]
                if "RAY_AUTH_MODE" not in names:
                    env.append({"name": "RAY_AUTH_MODE", "value": "token"})
                if "RAY_AUTH_TOKEN" not in names:
                    reference = {"name": secret, "key": RAY_AUTH_TOKEN_KEY}
                    env.append({"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": reference}})
            containers.append({**container, "env": env})
    return containers


def assert_token_auth(containers: list[dict[str, Any]]) -> None:
    assert containers
    for container in containers:
        env = {e["name"]: e for e in container.get("env", [])}
        for name, wanted in RAY_AUTH_ENV.items():
            assert env.get(name) == wanted, f"{container['name']}: {name} is {env.get(name)}"


def replica_containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


def test_every_ray_process_authenticates_with_the_one_token() -> None:
    """Head, workers, each replica's `ray start` and its driver: RAY_AUTH_MODE=token and the
    token from one Secret. Ray 2.60 turns token auth on by itself only for local clusters."""
    cluster = one("RayCluster")
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": RAY_AUTH_SECRET}
    assert_token_auth(ray_pod_containers(cluster))
    deployment = one("Deployment")
    assert_token_auth(replica_containers(deployment))
    # The replica's command runs `ray start` and the service in the container's environment.
    (container,) = replica_containers(deployment)
    assert "ray start" in container["command"][-1]


@pytest.mark.parametrize(
    "break_it",
    ["no authOptions", "head opts out", "worker sidecar", "replica without token", "other secret"],
)
def test_a_missing_token_is_caught(break_it: str) -> None:
    """The check above can fail: each way of leaving one Ray process without the token."""
    cluster, deployment = one("RayCluster"), one("Deployment")
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    (worker_group,) = cluster["spec"]["workerGroupSpecs"]
    replica = replica_containers(deployment)[0]
    if break_it == "no authOptions":
        del cluster["spec"]["authOptions"]
    elif break_it == "head opts out":  # a container's own value wins over KubeRay's
        head.setdefault("env", []).append({"name": "RAY_AUTH_MODE", "value": "disabled"})
    elif break_it == "worker sidecar":  # KubeRay sets the token on the first container only
        containers = worker_group["template"]["spec"]["containers"]
        containers.append({"name": "sidecar", "image": containers[0]["image"]})
    elif break_it == "replica without token":
        replica["env"] = [e for e in replica["env"] if e["name"] != "RAY_AUTH_TOKEN"]
    else:
        token = next(e for e in replica["env"] if e["name"] == "RAY_AUTH_TOKEN")
        token["valueFrom"]["secretKeyRef"]["name"] = "code-interpreter-keys"
    with pytest.raises(AssertionError):
        assert_token_auth(ray_pod_containers(cluster) + replica_containers(deployment))


def test_the_token_secret_is_documented() -> None:
    docs = (ROOT / "docs" / "cluster.md").read_text()
    assert f"kubectl create secret generic {RAY_AUTH_SECRET}" in docs
    assert f"--from-literal={RAY_AUTH_TOKEN_KEY}=" in docs
    assert "RAY_AUTH_MODE=token" in docs


def test_no_service_exposes_the_dashboard() -> None:
    """Neither our Services nor KubeRay's head Service (made from the head container's ports)
    carry the dashboard, and the dashboard listens on the head's loopback only."""
    services = [d for _, d in documents() if d["kind"] == "Service"]
    assert services
    head_spec = one("RayCluster")["spec"]["headGroupSpec"]
    (head,) = head_spec["template"]["spec"]["containers"]
    ports: list[Any] = [port for s in services for port in s["spec"]["ports"]]
    ports += head.get("ports", [])
    for port in ports:
        assert 8265 not in (port.get("port"), port.get("targetPort"), port.get("containerPort"))
        assert "dashboard" not in (port.get("name"), port.get("targetPort"))
    assert head_spec["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    for service in services:
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP"


def test_the_network_policies_select_the_pods_they_mean() -> None:
    """Ray's ports take connections from the Ray pods and the replicas only; a policy whose
    selector matched no pod would protect nothing without a word."""
    policies = {
        d["metadata"]["name"]: d["spec"] for _, d in documents() if d["kind"] == "NetworkPolicy"
    }
    ray_pods = {"ray.io/cluster": one("RayCluster")["metadata"]["name"]}  # KubeRay's label
    replicas = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    redis = one("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    members = [
        {"podSelector": {"matchLabels": ray_pods}},
        {"podSelector": {"matchLabels": replicas}},
    ]

    ray = policies["code-interpreter-ray"]
    assert ray["podSelector"]["matchLabels"] == ray_pods
    assert ray["ingress"] == [{"from": members}]

    front = policies["code-interpreter-replicas"]
    assert front["podSelector"]["matchLabels"] == replicas
    (container,) = replica_containers(one("Deployment"))
    assert {p["name"] for p in container["ports"]} == {"http"}
    assert front["ingress"] == [{"ports": [{"port": "http"}]}, {"from": members}]

    # Redis: the head and KubeRay's Redis cleanup job (KubeRay's ray.io/node-type), and the
    # replicas; never the worker pods, where the sandboxes run.
    store = policies["code-interpreter-redis"]
    assert store["podSelector"]["matchLabels"] == redis
    ray_head = {
        "matchLabels": ray_pods,
        "matchExpressions": [
            {"key": "ray.io/node-type", "operator": "In", "values": ["head", "redis-cleanup"]}
        ],
    }
    store_members = [{"podSelector": ray_head}, {"podSelector": {"matchLabels": replicas}}]
    assert store["ingress"] == [{"from": store_members, "ports": [{"port": "redis"}]}]
    for policy in policies.values():
        assert policy["policyTypes"] == ["Ingress"]


def test_the_replicas_service_needs_no_sticky_routing() -> None:
    """Any replica serves any request (docs/cluster.md, Routing), MCP connections included
    (tests/cluster/test_replica_mcp.py): the replicas' Service spreads clients freely."""
    spec = next(d for n, d in documents() if n == "service.yaml:Service")["spec"]
    assert spec.get("sessionAffinity", "None") == "None"
    docs = (ROOT / "docs" / "cluster.md").read_text()
    assert "needs no sticky routing" in docs


# --- what the replicas are given that must not be written in a manifest ------------------------

# (variable, Secret, key): the bearer keys, the console's login secret, the store's password.
REPLICA_SECRETS = [
    ("CODE_INTERPRETER_API_KEYS", "code-interpreter-keys", "api-keys"),
    ("CODE_INTERPRETER_CONSOLE_SECRET", "code-interpreter-console", "secret"),
    ("REDIS_PASSWORD", "code-interpreter-redis", "password"),
]


def assert_secrets_by_reference(container: dict[str, Any]) -> None:
    """Each of REPLICA_SECRETS read from its Secret, and the store URL carrying the password
    only as $(REDIS_PASSWORD), listed after it (Kubernetes expands only variables defined
    earlier in the list; a later one would be left as the literal text)."""
    names = [e["name"] for e in container["env"]]
    env = {e["name"]: e for e in container["env"]}
    for name, secret, key in REPLICA_SECRETS:
        assert name in env, f"{name} is not given"
        assert "value" not in env[name], f"{name} is written in the manifest"
        assert env[name]["valueFrom"] == {"secretKeyRef": {"name": secret, "key": key}}, name
    store_url = env["CODE_INTERPRETER_STORE_URL"]["value"]
    assert "$(REDIS_PASSWORD)@" in store_url
    assert names.index("REDIS_PASSWORD") < names.index("CODE_INTERPRETER_STORE_URL")


def test_the_replicas_read_their_secrets_from_kubernetes_secrets() -> None:
    """The console's secret as the keys and the store's password are: every replica reads the
    same one (a login made on one holds on all), made as docs/cluster.md says (at least the 32
    characters `console_secret` needs)."""
    (container,) = replica_containers(one("Deployment"))
    assert_secrets_by_reference(container)
    docs = (ROOT / "docs" / "cluster.md").read_text()
    made = re.search(
        r"kubectl create secret generic code-interpreter-console \\\s*"
        r'--from-literal=secret="\$\(openssl rand -hex (\d+)\)"',
        docs,
    )
    assert made is not None, "docs/cluster.md does not say how to make the console's Secret"
    assert 2 * int(made.group(1)) >= 32


@pytest.mark.parametrize("break_it", ["literal", "other secret", "missing", "url after"])
def test_a_secret_written_in_the_manifest_is_caught(break_it: str) -> None:
    """The check above can fail: the console's secret written in, read from another Secret,
    left out; the store URL listed before the password it expands."""
    (container,) = replica_containers(one("Deployment"))
    env = container["env"]
    console = next(e for e in env if e["name"] == "CODE_INTERPRETER_CONSOLE_SECRET")
    if break_it == "literal":
        console.pop("valueFrom")
        console["value"] = "x" * 32
    elif break_it == "other secret":
        console["valueFrom"]["secretKeyRef"]["name"] = "code-interpreter-keys"
    elif break_it == "missing":
        env.remove(console)
    else:
        url = next(e for e in env if e["name"] == "CODE_INTERPRETER_STORE_URL")
        env.remove(url)
        env.insert(0, url)
    with pytest.raises(AssertionError):
        assert_secrets_by_reference(container)
