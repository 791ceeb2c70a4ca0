"""``shardserve up`` end to end: real scheduler, gateway and agent processes on a real
broker. The mesh gets ready, answers, heals after an agent is killed, and on SIGTERM
stops every process it started and exits 0."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, condition: Callable[[], bool], within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def infer_all_ones(base: str, model: str = "matmul") -> set[float]:
    body = {"inputs": [{"name": "x", "shape": [128, 96], "datatype": "FP32",
                        "data": [1.0] * (128 * 96)}]}  # fmt: skip
    request = urllib.request.Request(
        f"{base}/v2/models/{model}/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        answer = json.loads(response.read())
    [output] = answer["outputs"]
    assert (output["name"], output["shape"]) == ("y", [128, 16])
    return set(output["data"])


def children_of(pid: int) -> dict[int, str]:
    """Live (non-zombie) direct children of ``pid``: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found[int(entry.name)] = cmdline
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def agent_pid(children: dict[int, str], rank: int) -> int | None:
    # the thread count is the launcher's share of this machine's cores (any count)
    wanted = re.compile(rf"--rank {rank} --threads \d+$")
    return next((p for p, cmd in children.items() if wanted.search(cmd)), None)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    subprocess.run(
        [sys.executable, "-m", "shardserve.cli", "export", "matmul", "--rank-size", "2",
         "--out", str(folder)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return folder


@pytest.fixture
def warmed_repo(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``repo`` after ``shardserve warmup`` with its defaults, into a private cache home
    that the launched mesh uses too (XDG_CACHE_HOME)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache-home"))
    done = subprocess.run(
        [sys.executable, "-m", "shardserve.cli", "warmup", str(repo)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "2 rank(s): 2 built" in done.stdout
    return repo


Launched = tuple[subprocess.Popen[bytes], str, Path]


@contextmanager
def running_up(repo: Path, tmp_path: Path, amqp_url: str, *extra: str) -> Iterator[Launched]:
    """``shardserve up REPO ...`` on a free port; every process killed if left running."""
    port = free_port()
    log = tmp_path / "up.log"
    env = {**os.environ, "SHARDSERVE_AMQP_URL": amqp_url}
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "shardserve.cli", "up", str(repo), "--http-port", str(port),
             "--grace-seconds", "10", *extra],
            stdout=sink, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        yield process, f"http://127.0.0.1:{port}", log
    finally:
        if process.poll() is None:  # the test failed half-way: leave nothing behind
            for child in children_of(process.pid):
                os.killpg(child, signal.SIGKILL)
            process.kill()
            process.wait(timeout=30)


@pytest.fixture
def launcher(repo: Path, tmp_path: Path, isolated_amqp_url: str) -> Iterator[Launched]:
    with running_up(repo, tmp_path, isolated_amqp_url) as launched:
        yield launched


def test_up_serves_heals_and_stops_every_process(
    launcher: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    process, base, log = launcher

    def ready() -> bool:
        assert process.poll() is None, log.read_text()
        return http_status(f"{base}/v2/health/ready") == 200

    wait_for("the mesh to get ready", ready)
    assert infer_all_ones(base) == {-48.0}
    wait_for("the ready banner", lambda: "all groups ready" in log.read_text(), 30)
    assert f"all groups ready: POST {base}/v2/models/matmul/infer" in log.read_text()
    assert "matmul v1: 2/2 ranks ready" in log.read_text()

    children = children_of(process.pid)
    assert len(children) == 4, children  # scheduler, gateway, 2 agents
    assert sum("-m shardserve_agent" in cmd for cmd in children.values()) == 2

    # An agent dies: the launcher restarts it and the group heals.
    victim = agent_pid(children, 1)
    assert victim is not None, children
    os.kill(victim, signal.SIGKILL)
    wait_for("agent r1 to restart", lambda: agent_pid(children_of(process.pid), 1) not in
             (None, victim), 60)  # fmt: skip
    successor = agent_pid(children_of(process.pid), 1)
    # (readiness may not have dropped yet: the scheduler notices the loss at its heartbeat
    # timeout, and the successor's registration waits for it)
    wait_for("the successor to serve rank 1", lambda: ready() and rank_served_by(base, 1)
             == successor, 60)  # fmt: skip
    assert infer_all_ones(base) == {-48.0}
    assert "[agent matmul r1] was killed by SIGKILL; restarting in" in log.read_text()

    everyone = children_of(process.pid)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=90) == 0, log.read_text()
    assert [pid for pid in everyone if alive(pid)] == []
    text = log.read_text()
    assert "stopping: gateway, then scheduler, then agents" in text
    gateway_stop = text.index("[gateway]", text.index("stopping:"))
    agent_stop = text.index("[agent matmul r0]", text.index("stopping:"))
    assert gateway_stop < agent_stop
    assert text.rstrip().endswith("stopped")


def listeners(base: str) -> int:
    """Listening TCP sockets on the port of ``base`` (Linux /proc/net/tcp, state 0A)."""
    port = f"{int(base.rsplit(':', 1)[1]):04X}"
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for row in rows if row.split()[1].endswith(f":{port}") and row.split()[3] == "0A")


def gateway_pids(pid: int) -> list[int]:
    return sorted(p for p, cmd in children_of(pid).items() if "-m shardserve_gateway" in cmd)


def test_several_gateways_share_the_port_and_one_dying_loses_no_request(
    repo: Path, tmp_path: Path, isolated_amqp_url: str
) -> None:
    with running_up(repo, tmp_path, isolated_amqp_url, "--gateways", "2") as (process, base, log):
        wait_for("the mesh to get ready", lambda: http_status(f"{base}/v2/health/ready") == 200)
        gateways = gateway_pids(process.pid)
        assert len(gateways) == 2, children_of(process.pid)
        assert all("--reuse-port" in children_of(process.pid)[p] for p in gateways)
        wait_for("both gateways to listen", lambda: log.read_text().count(" listening on ") == 2)
        assert infer_all_ones(base) == {-48.0}

        # One gateway dies: once its listening socket is gone (connections still queued
        # on a dying listener are reset with it; the socket can outlive the process's
        # zombie state while its other threads exit), the kernel hands new connections to
        # the other one only, so every request gets its answer while the launcher
        # restarts the dead one.
        assert listeners(base) == 2
        os.kill(gateways[0], signal.SIGKILL)
        wait_for("its listening socket to close", lambda: listeners(base) == 1, 30)
        answers = [infer_all_ones(base) for _ in range(20)]
        assert answers == [{-48.0}] * 20
        wait_for("the gateway to restart", lambda: len(gateway_pids(process.pid)) == 2
                 and gateways[0] not in gateway_pids(process.pid), 60)  # fmt: skip
        wait_for("the successor to listen", lambda: log.read_text().count(" listening on ") == 3)
        assert [infer_all_ones(base) for _ in range(10)] == [{-48.0}] * 10

        everyone = children_of(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0, log.read_text()
        assert [pid for pid in everyone if alive(pid)] == []


def rank_served_by(base: str, rank: int) -> int | None:
    """The pid of the ready instance serving ``rank`` of matmul v1, per /api/status."""
    try:
        with urllib.request.urlopen(f"{base}/api/status", timeout=5) as response:
            status = json.loads(response.read())
    except OSError:
        return None
    for servable in status.get("servables", ()):
        if (servable["name"], servable["version"]) == ("matmul", 1):
            for entry in servable["ranks"]:
                if entry["rank"] == rank and entry["state"] == "ready":
                    return int(entry["pid"])
    return None


def agents_of_version(pid: int, version: int) -> set[int]:
    return {p for p, cmd in children_of(pid).items()
            if "-m shardserve_agent" in cmd and f" --version {version} " in cmd}  # fmt: skip


def test_a_version_added_while_up_runs_gets_agents_and_loses_them_when_removed(
    launcher: tuple[subprocess.Popen[bytes], str, Path], repo: Path
) -> None:
    process, base, log = launcher
    v2_ready = f"{base}/v2/models/matmul/versions/2/ready"

    def ready(url: str) -> bool:
        assert process.poll() is None, log.read_text()
        return http_status(url) == 200

    wait_for("the mesh to get ready", lambda: ready(f"{base}/v2/health/ready"))
    v1_agents = agents_of_version(process.pid, 1)
    assert len(v1_agents) == 2

    # A new version, exported into the running repository: its agents start, v1's stay.
    subprocess.run(
        [sys.executable, "-m", "shardserve.cli", "export", "matmul", "--rank-size", "2",
         "--version", "2", "--out", str(repo)],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    wait_for("version 2 to get ready", lambda: ready(v2_ready))
    assert infer_all_ones(base, "matmul/versions/2") == {-48.0}
    assert len(agents_of_version(process.pid, 2)) == 2
    assert agents_of_version(process.pid, 1) == v1_agents  # not restarted
    assert "matmul v2: new version (2 ranks)" in log.read_text()
    assert "matmul v2: the scheduler loaded it; starting its agents" in log.read_text()

    # The folder goes: the scheduler drains and unloads v2, its agents leave for good.
    shutil.rmtree(repo / "matmul" / "2")
    wait_for("v2's agents to leave", lambda: not agents_of_version(process.pid, 2), 60)
    assert http_status(v2_ready) == 404
    assert "matmul v2: its folder is gone" in log.read_text()
    assert agents_of_version(process.pid, 1) == v1_agents
    assert infer_all_ones(base) == {-48.0}

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=90) == 0, log.read_text()


def test_up_without_a_broker_says_which_variable_to_set(repo: Path) -> None:
    env = {**os.environ, "SHARDSERVE_AMQP_URL": "amqp://guest:secret@127.0.0.1:1/"}
    result = subprocess.run(
        [sys.executable, "-m", "shardserve.cli", "up", str(repo)],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 1
    assert "cannot reach RabbitMQ" in result.stderr
    assert "SHARDSERVE_AMQP_URL" in result.stderr
    assert "secret" not in result.stderr
    assert "Traceback" not in result.stderr


def test_agents_started_by_up_hit_the_cache_warmup_built_with_its_defaults(
    warmed_repo: Path, launcher: tuple[subprocess.Popen[bytes], str, Path]
) -> None:
    # warmup's default thread count is up's: the thread count is part of the cache key
    process, base, log = launcher
    wait_for("the mesh to get ready", lambda: http_status(f"{base}/v2/health/ready") == 200)
    text = log.read_text()
    assert text.count("compile cache hit") == 2, text[-3000:]
    assert "compile cache miss" not in text
