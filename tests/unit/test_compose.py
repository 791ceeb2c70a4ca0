"""docker-compose.yml, deploy/Dockerfile and the RabbitMQ definitions agree with the code:
every command parses with the parser that will run it, the agents cover the group, start
and stop orders drain, and each service's broker user may do exactly what topology.py
says that service does. The rules a real run taught (scripts/compose-check runs the stack
end to end) are kept here as structure: base images are parameters with the official
images as defaults, one service builds the image, the gateway's port is a variable, the
broker is healthy only once AMQP connections are accepted, the image has no VOLUME and
installs pinned dependencies."""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.util
import json
import re
import tomllib
from graphlib import TopologicalSorter
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from shardserve import cli
from shardserve.wire import topology

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DEFINITIONS = json.loads((ROOT / "deploy" / "rabbitmq" / "definitions.json").read_text())
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
AGENTS = sorted(name for name in SERVICES if name.startswith("agent-"))
OUR_IMAGE = "${SHARDSERVE_IMAGE:-shardserve:dev}"
OURS = sorted(name for name, svc in SERVICES.items() if svc.get("image") == OUR_IMAGE)
VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: str, env: dict[str, str]) -> str:
    """What compose (v1 and v2) makes of ``${NAME}`` and ``${NAME:-default}``."""
    return VARIABLE.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)


def service_parser(role: str) -> Any:
    module = importlib.import_module(f"shardserve_{role}.settings")
    return module.build_parser()


def test_the_mesh_is_all_there() -> None:
    assert set(SERVICES) == {"rabbitmq", "export", "scheduler", "gateway", *AGENTS}
    assert AGENTS == [f"agent-{r}" for r in range(8)]
    assert set(OURS) == set(SERVICES) - {"rabbitmq"}


@pytest.mark.parametrize("name", OURS)
def test_each_command_is_a_cli_subcommand(name: str) -> None:
    command = SERVICES[name]["command"]
    assert command[0] in cli.SUBCOMMANDS


@pytest.mark.parametrize("name", [n for n in OURS if n != "export"])
def test_service_commands_parse_with_the_services_own_parsers(name: str) -> None:
    role, *args = SERVICES[name]["command"]
    assert role in cli.SERVICES
    service_parser(role).parse_args(args)


def test_export_command_parses_with_the_cli_parser() -> None:
    args = cli.build_parser().parse_args(SERVICES["export"]["command"])
    assert (args.command, args.model, args.rank_size, args.stage_size) == ("export", "matmul", 8, 1)
    assert (args.strategy, str(args.out), args.if_missing) == ("column", "/models", True)


def _agent_args(name: str) -> dict[str, str]:
    _, *args = SERVICES[name]["command"]
    return dict(zip(args[::2], args[1::2], strict=True))


def test_agents_cover_ranks_0_to_7_exactly_once() -> None:
    ranks = sorted(int(_agent_args(name)["--rank"]) for name in AGENTS)
    assert ranks == list(range(8))
    assert {_agent_args(n)["--servable"] for n in AGENTS} == {"matmul"}
    assert {_agent_args(n)["--repository"] for n in AGENTS} == {"/models"}
    export = cli.build_parser().parse_args(SERVICES["export"]["command"])
    assert export.rank_size == len(AGENTS)


def test_agents_parse_to_their_rank_with_the_agent_parser() -> None:
    parser = service_parser("agent")
    for name in AGENTS:
        _, *args = SERVICES[name]["command"]
        settings = parser.parse_args(args)
        assert settings.rank == int(name.removeprefix("agent-"))


def test_interpolate_reads_like_compose() -> None:
    assert interpolate("${A:-x}:${B}", {}) == "x:"
    assert interpolate("${A:-x}:${B}", {"A": "1", "B": "2"}) == "1:2"
    assert interpolate("${A:-x}", {"A": ""}) == "x"  # `:-` also replaces an empty value


def _gateway_port_mapping(env: dict[str, str], which: int = 0) -> tuple[str, str, str]:
    """The gateway's published ports: [0] HTTP, [1] gRPC."""
    mapping = SERVICES["gateway"]["ports"][which]
    address, host_port, container_port = interpolate(mapping, env).split(":")
    return address, host_port, container_port


def test_gateway_listens_on_all_interfaces_and_publishes_a_variable_port() -> None:
    gateway = SERVICES["gateway"]
    args = dict(zip(gateway["command"][1::2], gateway["command"][2::2], strict=True))
    assert args["--host"] == "0.0.0.0"  # inside the container: the published port reaches it
    assert _gateway_port_mapping({}) == ("0.0.0.0", "8080", args["--http-port"])
    # One string with variables: an override file would append a second mapping instead.
    local = {"SHARDSERVE_GATEWAY_ADDRESS": "127.0.0.1", "SHARDSERVE_GATEWAY_PORT": "18080"}
    assert _gateway_port_mapping(local) == ("127.0.0.1", "18080", args["--http-port"])
    assert _gateway_port_mapping({}, 1) == ("0.0.0.0", "8001", args["--grpc-port"])
    grpc = {"SHARDSERVE_GATEWAY_GRPC_HOST_PORT": "18001"}
    assert _gateway_port_mapping(grpc, 1) == ("0.0.0.0", "18001", args["--grpc-port"])


def test_only_export_builds_the_image_the_others_run_by_name() -> None:
    builders = [name for name, svc in SERVICES.items() if "build" in svc]
    assert builders == ["export"]
    build = SERVICES["export"]["build"]
    assert build["dockerfile"] == "deploy/Dockerfile"
    assert (ROOT / build["context"] / "deploy" / "Dockerfile").is_file()
    # Every service that needs the image starts after the one that builds it.
    for name in set(OURS) - {"export", "gateway"}:
        assert "export" in SERVICES[name]["depends_on"]
    assert "scheduler" in SERVICES["gateway"]["depends_on"]


def test_base_images_are_parameters_with_the_official_images_as_defaults() -> None:
    python_arg = SERVICES["export"]["build"]["args"]["PYTHON_IMAGE"]
    rabbitmq = SERVICES["rabbitmq"]["image"]
    assert interpolate(python_arg, {}) == "python:3.11-slim"
    assert interpolate(rabbitmq, {}) == "rabbitmq:3.13"
    stand_ins = {
        "SHARDSERVE_PYTHON_IMAGE": "shardserve-standin/python:3.11",
        "SHARDSERVE_RABBITMQ_IMAGE": "shardserve-standin/rabbitmq:3",
    }
    assert interpolate(python_arg, stand_ins) == "shardserve-standin/python:3.11"
    assert interpolate(rabbitmq, stand_ins) == "shardserve-standin/rabbitmq:3"
    assert interpolate(OUR_IMAGE, {}) == "shardserve:dev"


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", dockerfile)  # continuation lines
    lines = [line.strip() for line in joined.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def test_dockerfile_takes_its_base_as_an_arg_with_the_official_default() -> None:
    steps = _instructions(DOCKERFILE)
    assert steps[0] == ("ARG", "PYTHON_IMAGE=python:3.11-slim")  # before FROM: usable in FROM
    froms = [arg for op, arg in steps if op == "FROM"]
    assert froms == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE}"]


def test_image_runs_the_cli_as_non_root_without_volumes() -> None:
    steps = _instructions(DOCKERFILE)
    assert ("ENTRYPOINT", '["shardserve"]') in steps
    assert 'shardserve = "shardserve.cli:main"' in (ROOT / "pyproject.toml").read_text()
    users = [arg for op, arg in steps if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    # A VOLUME gives every container of the image an anonymous volume `down` leaves behind.
    assert [op for op, _ in steps if op == "VOLUME"] == []
    # The sources the image installs are the ones pyproject packages.
    for folder in ("shared", "services"):
        assert ("COPY", f"{folder} ./{folder}") in steps


def test_image_installs_the_pinned_constraints() -> None:
    steps = _instructions(DOCKERFILE)
    assert ("COPY", "deploy/constraints.txt ./deploy/constraints.txt") in steps
    [install] = [arg for op, arg in steps if op == "RUN" and "pip install" in arg]
    assert "--constraint deploy/constraints.txt ." in install


def _ignore_patterns(path: Path) -> list[str]:
    lines = [line.strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_both_builders_see_the_same_small_context() -> None:
    legacy = _ignore_patterns(ROOT / ".dockerignore")  # the only file the legacy builder reads
    assert legacy == _ignore_patterns(ROOT / "deploy" / "Dockerfile.dockerignore")  # BuildKit
    assert legacy[0] == "**"  # everything out (.git, .venv, caches, results) ...
    kept = {p.removeprefix("!") for p in legacy if p.startswith("!")}
    copied = {
        source
        for op, arg in _instructions(DOCKERFILE)
        if op == "COPY" and not arg.startswith("--from")
        for source in arg.split()[:-1]
    }
    assert kept == copied  # ... but what the image copies


# ---------------------------------------------------------------- the lock file


def _lock_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "lock_constraints", ROOT / "deploy" / "lock_constraints.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pins() -> dict[str, str]:
    text = (ROOT / "deploy" / "constraints.txt").read_text()
    pairs = re.findall(r"^([A-Za-z0-9._-]+)==(\S+)$", text, re.M)
    return {canonicalize_name(name): version for name, version in pairs}


def test_constraints_pin_every_runtime_dependency_within_pyproject() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = _pins()
    for text in dependencies:
        requirement = Requirement(text)
        pinned = pins.get(canonicalize_name(requirement.name))
        assert pinned is not None, f"{requirement.name} is not in deploy/constraints.txt"
        assert requirement.specifier.contains(pinned, prereleases=True), (text, pinned)
    assert not {"pytest", "mypy", "ruff", "hypothesis"} & set(pins)  # no dev tools


def test_closure_follows_markers_extras_and_cycles() -> None:
    graph = {
        "app": ["lib[fast]>=1", "winonly; sys_platform == 'win32'", "Cyc"],
        "lib": ["base", "speedup; extra == 'fast'", "docs; extra == 'docs'"],
        "base": [],
        "speedup": ["base"],
        "cyc": ["app"],
    }
    closure = _lock_module().closure(
        ["app"], lambda name: graph[canonicalize_name(name)], lambda name: f"1.{len(name)}"
    )
    assert closure == {"app": "1.3", "lib": "1.3", "base": "1.4", "speedup": "1.7", "cyc": "1.3"}


def test_compose_check_sees_stopped_containers_with_either_compose() -> None:
    """Compose v2's ``ps`` lists running containers only (v1's lists all): the restart and
    stop checks read ``ps -a`` (both accept it) and require one container per service, so
    that a check over no containers cannot pass."""
    script = (ROOT / "scripts" / "compose-check").read_text()
    assert re.search(r"compose ps (-q|\$)", script) is None
    assert 'containers() { compose ps -a -q "$@"; }' in script
    assert script.count('all_listed "$') == 2  # restart counts and exit codes


def test_rabbitmq_is_healthy_once_it_accepts_amqp_connections() -> None:
    rabbit = SERVICES["rabbitmq"]
    # `ping` answers while the node boots, before the AMQP listener accepts connections.
    assert rabbit["healthcheck"]["test"] == [
        "CMD",
        "rabbitmq-diagnostics",
        "-q",
        "check_port_connectivity",
    ]


def test_rabbitmq_loads_the_definitions() -> None:
    rabbit = SERVICES["rabbitmq"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in rabbit["volumes"]}
    conf = (ROOT / "deploy" / "rabbitmq" / "rabbitmq.conf").read_text()
    loaded = re.search(r"^load_definitions = (\S+)$", conf, re.M)
    assert loaded, "rabbitmq.conf must load the definitions"
    assert mounts[loaded.group(1)] == "./deploy/rabbitmq/definitions.json"
    assert mounts["/etc/rabbitmq/rabbitmq.conf"] == "./deploy/rabbitmq/rabbitmq.conf"


def _depends(name: str) -> dict[str, str]:
    return {dep: spec["condition"] for dep, spec in SERVICES[name].get("depends_on", {}).items()}


def test_depends_on_waits_for_a_healthy_broker_and_a_finished_export() -> None:
    for name in [*AGENTS, "scheduler"]:
        deps = _depends(name)
        assert deps["rabbitmq"] == "service_healthy"
        assert deps["export"] == "service_completed_successfully"
    assert _depends("gateway")["rabbitmq"] == "service_healthy"
    assert _depends("export") == {}
    assert SERVICES["export"].get("restart") == "no"


def test_stop_order_drains_gateway_then_scheduler_then_agents() -> None:
    graph = {name: set(_depends(name)) for name in SERVICES}
    start = list(TopologicalSorter(graph).static_order())
    stop = start[::-1]  # compose stops dependents first
    assert stop.index("gateway") < stop.index("scheduler")
    assert all(stop.index("scheduler") < stop.index(agent) for agent in AGENTS)
    assert stop[-1] == "rabbitmq"
    for name in ("gateway", "scheduler", *AGENTS):
        assert SERVICES[name]["stop_grace_period"] == "20s"  # > the services' 10 s drain


def test_models_volume_is_read_only_except_for_the_export() -> None:
    assert "models:/models" in SERVICES["export"]["volumes"]
    for name in ("scheduler", *AGENTS):
        assert "models:/models:ro" in SERVICES[name]["volumes"]


# ---------------------------------------------------------------- broker users


def _amqp_user(name: str) -> tuple[str, str]:
    url = urlsplit(SERVICES[name]["environment"]["SHARDSERVE_AMQP_URL"])
    assert url.hostname == "rabbitmq"
    assert url.username and url.password
    return url.username, url.password


def _password_matches(stored: str, password: str) -> bool:
    raw = base64.b64decode(stored)
    salt, digest = raw[:4], raw[4:]
    return hashlib.sha256(salt + password.encode()).digest() == digest


def test_no_guest_and_one_user_per_service_with_the_compose_password() -> None:
    users = {u["name"]: u for u in DEFINITIONS["users"]}
    assert "guest" not in users
    assert set(users) == {"gateway", "scheduler", "agent"}
    for name in ("gateway", "scheduler", *AGENTS):
        user, password = _amqp_user(name)
        assert user == ("agent" if name.startswith("agent-") else name)
        assert users[user]["hashing_algorithm"] == "rabbit_password_hashing_sha256"
        assert _password_matches(users[user]["password_hash"], password)
        assert users[user]["tags"] == []
    assert not _password_matches(users["agent"]["password_hash"], "gateway-dev-password")


EXCHANGE_NAMES = [e.name for e in topology.EXCHANGES]
DEFAULT_EXCHANGE = "amq.default"


def _needs() -> dict[str, dict[str, list[str]]]:
    """What each service does on the broker, per RabbitMQ permission, from topology.py.

    configure: declare an exchange or queue. write: publish to an exchange; bind a queue
    (on the queue); be a queue's dead-letter target. read: consume a queue; bind (on the
    exchange); declare a queue with a dead-letter exchange (on the queue).
    """
    reply, status = topology.reply_queue("gw1").name, topology.status_queue("gw1").name
    scheduler_queues = [
        topology.REQUEST_QUEUE,
        topology.QUORUM_REQUEST_QUEUE,
        topology.scheduler_control_queue("sched-1").name,
        topology.scheduler_result_queue("sched-1").name,
        topology.SCHEDULER_LEADER_QUEUE,
        topology.DEAD_LETTER_QUEUE,
    ]
    agent_queues = [
        topology.agent_work_queue("matmul", 1, 3).name,
        topology.agent_collective_queue("matmul", 1, 3).name,
        topology.agent_control_queue("a1b2").name,
    ]
    bound_from = {b.exchange for b in topology.scheduler_bindings("sched-1")}
    agent_bound_from = {b.exchange for b in topology.agent_bindings("matmul", 1, 3, 0, "a1b2")}
    return {
        "gateway": {
            "configure": [*EXCHANGE_NAMES, reply, status],
            "write": [topology.REQUESTS_EXCHANGE, reply, status],
            "read": [reply, status, topology.CONTROL_EXCHANGE],
        },
        "scheduler": {
            "configure": [*EXCHANGE_NAMES, *scheduler_queues],
            "write": [
                topology.STAGE_EXCHANGE,
                topology.CONTROL_EXCHANGE,
                topology.DEAD_EXCHANGE,
                DEFAULT_EXCHANGE,
                *scheduler_queues,
            ],
            "read": [*scheduler_queues, *bound_from],
        },
        "agent": {
            "configure": [*EXCHANGE_NAMES, *agent_queues],
            "write": [
                topology.COLLECTIVE_EXCHANGE,
                topology.CONTROL_EXCHANGE,
                topology.DEAD_EXCHANGE,
                DEFAULT_EXCHANGE,
                *agent_queues,
            ],
            "read": [*agent_queues, *agent_bound_from],
        },
    }


FORBIDDEN = {
    "gateway": {
        "read": [
            topology.REQUEST_QUEUE,
            topology.QUORUM_REQUEST_QUEUE,
            topology.agent_work_queue("m", 1, 0).name,
        ],
        "write": [topology.STAGE_EXCHANGE, topology.COLLECTIVE_EXCHANGE, DEFAULT_EXCHANGE],
    },
    "scheduler": {
        "read": [topology.reply_queue("gw1").name, topology.agent_work_queue("m", 1, 0).name],
        "write": [topology.COLLECTIVE_EXCHANGE],
        "configure": [topology.agent_work_queue("m", 1, 0).name],
    },
    "agent": {
        "read": [
            topology.REQUEST_QUEUE,
            topology.QUORUM_REQUEST_QUEUE,
            topology.scheduler_result_queue("s").name,
        ],
        "write": [topology.REQUESTS_EXCHANGE, topology.STAGE_EXCHANGE],
        # (each request queue type has its own name: ".c1" classic, ".q1" quorum)
        "configure": [
            topology.scheduler_result_queue("s").name,
            topology.scheduler_control_queue("s").name,
            topology.REQUEST_QUEUE,
            topology.QUORUM_REQUEST_QUEUE,
        ],
    },
}


def _permissions(user: str) -> dict[str, str]:
    [entry] = [p for p in DEFINITIONS["permissions"] if p["user"] == user]
    assert entry["vhost"] == "/"
    return entry


@pytest.mark.parametrize("user", ["gateway", "scheduler", "agent"])
def test_permissions_allow_what_the_service_does(user: str) -> None:
    perms = _permissions(user)
    missing = [
        f"{kind} {name}"
        for kind, names in _needs()[user].items()
        for name in names
        if not re.search(perms[kind], name)  # RabbitMQ searches, like re.search
    ]
    assert missing == []


@pytest.mark.parametrize("user", ["gateway", "scheduler", "agent"])
def test_permissions_refuse_other_services_resources(user: str) -> None:
    perms = _permissions(user)
    allowed = [
        f"{kind} {name}"
        for kind, names in FORBIDDEN[user].items()
        for name in names
        if re.search(perms[kind], name)
    ]
    assert allowed == []


def test_every_permission_regex_is_anchored() -> None:
    for entry in DEFINITIONS["permissions"]:
        for kind in ("configure", "write", "read"):
            assert entry[kind].startswith("^") and entry[kind].endswith("$"), (entry, kind)
