"""deploy/k8s/: every manifest parses, and what it runs is what the code accepts.

Commands are parsed with the services' own parsers (``build_parser``), with the env
the manifest gives the container; probe paths must be routes the gateway app registers;
probe ports must be ports the container declares and the gateway listens on.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardserve import cli

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
MANIFESTS = sorted(K8S.glob("*.yaml"))


def _documents() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in MANIFESTS:
        docs.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in _documents() if d["kind"] == kind]


def _workload(component: str) -> dict[str, Any]:
    [doc] = [
        d
        for d in _documents()
        if d["kind"] in ("Deployment", "StatefulSet")
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    return doc


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    [container] = doc["spec"]["template"]["spec"]["containers"]
    return container


def _placeholder_env(container: dict[str, Any], rank: int = 3) -> dict[str, str]:
    """The container's env as the service would see it (secrets/downward API faked)."""
    env: dict[str, str] = {}
    for item in container.get("env", ()):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "pod-index" in str(item.get("valueFrom")):
            env[item["name"]] = str(rank)
        else:
            env[item["name"]] = "placeholder"
    return env


def _service_args(container: dict[str, Any], service: str) -> list[str]:
    args = list(container["args"])
    assert args[0] == service, f"{service} container runs {args[0]!r}"
    assert service in cli.SERVICES
    return args[1:]


def _parse(service: str, container: dict[str, Any]) -> argparse.Namespace:
    env = _placeholder_env(container)
    argv = _service_args(container, service)
    if service == "gateway":
        from shardserve_gateway.settings import build_parser as gateway_parser

        return gateway_parser(env).parse_args(argv)
    if service == "scheduler":
        from shardserve_scheduler.settings import build_parser as scheduler_parser

        return scheduler_parser(env).parse_args(argv)
    from shardserve_agent.settings import build_parser as agent_parser

    return agent_parser(env).parse_args(argv)


def test_every_manifest_parses_and_names_its_kind() -> None:
    assert MANIFESTS, "deploy/k8s has no manifests"
    kinds = {d["kind"] for d in _documents()}
    assert {"Deployment", "StatefulSet", "Service", "RabbitmqCluster"} <= kinds
    for doc in _documents():
        assert doc["apiVersion"] and doc["metadata"]["name"]


def test_agents_are_a_statefulset_whose_ordinal_is_the_rank() -> None:
    agents = _workload("agent")
    assert agents["kind"] == "StatefulSet"
    container = _container(agents)
    args = _parse("agent", container)
    assert args.rank == 3  # from SHARDSERVE_AGENT_RANK = the pod index (faked as 3)
    rank_env = next(e for e in container["env"] if e["name"] == "SHARDSERVE_AGENT_RANK")
    assert "apps.kubernetes.io/pod-index" in rank_env["valueFrom"]["fieldRef"]["fieldPath"]
    assert "--rank" not in container["args"]
    # One volume per rank, mounted where the agent's repository is.
    [claim] = agents["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert str(args.repository).startswith(mounts[claim["metadata"]["name"]])


def test_schedulers_run_active_and_standby() -> None:
    scheduler = _workload("scheduler")
    assert scheduler["kind"] == "Deployment"
    assert scheduler["spec"]["replicas"] == 2
    args = _parse("scheduler", _container(scheduler))
    assert args.repository is not None
    # on the three-node cluster, requests survive a node's loss
    assert args.request_queue == "quorum"


def test_gateways_are_replicated_and_probed_on_real_routes() -> None:
    gateway = _workload("gateway")
    assert gateway["spec"]["replicas"] >= 2
    container = _container(gateway)
    args = _parse("gateway", container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.http_port in ports.values()
    assert args.host == "0.0.0.0"
    routes = _gateway_get_routes(args)
    probes = {"readinessProbe": "/v2/health/ready", "livenessProbe": "/v2/health/live"}
    for probe, expected in probes.items():
        get = container[probe]["httpGet"]
        assert get["path"] == expected and get["path"] in routes, (probe, routes)
        port = get["port"]
        assert (ports[port] if isinstance(port, str) else port) == args.http_port
    [service] = [s for s in _by_kind("Service") if s["metadata"]["name"] == "shardserve-gateway"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports) | set(ports.values())


def _gateway_get_routes(args: argparse.Namespace) -> set[str]:
    from shardserve_gateway.app import create_app
    from shardserve_gateway.settings import GatewaySettings

    app = create_app(GatewaySettings.from_args(args, {}))
    return {
        route.resource.canonical
        for route in app.router.routes()
        if route.method == "GET" and route.resource is not None
    }


def test_every_shardserve_pod_gets_the_broker_url_from_the_operator_secret() -> None:
    [cluster] = _by_kind("RabbitmqCluster")
    secret = f"{cluster['metadata']['name']}-default-user"
    for component in ("agent", "scheduler", "gateway"):
        env = {e["name"]: e for e in _container(_workload(component))["env"]}
        url = env["SHARDSERVE_AMQP_URL"]["value"]
        assert url.startswith("amqp") and cluster["metadata"]["name"] in url
        for name in ("AMQP_USER", "AMQP_PASSWORD"):
            assert env[name]["valueFrom"]["secretKeyRef"]["name"] == secret
            assert f"$({name})" in url


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_use_the_shardserve_namespace(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "shardserve"


def test_the_broker_is_clustered_for_quorum_queues() -> None:
    [cluster] = _by_kind("RabbitmqCluster")
    assert cluster["spec"]["replicas"] >= 3  # a quorum survives one node's loss
