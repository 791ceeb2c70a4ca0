"""Extra RabbitMQ nodes on this machine, for cluster, TLS and multi-host tests.

Each node is a separate ``rabbitmq-server`` with its own node name, ports, config,
mnesia and log folders under one temporary base folder, and an Erlang cookie of its own
(HOME points into the base folder), so nothing touches the machine's main broker.
Used by ``scripts/rabbit-cluster``, ``scripts/netns-hosts`` and the integration tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

RABBIT_BIN = Path("/usr/lib/rabbitmq/bin")
START_TIMEOUT_S = 90.0
DIST_PORT_OFFSET = 20000  # a node's Erlang distribution port is its AMQP port + this


class NodeError(Exception):
    """A node could not be started or driven; the message says why."""


def rabbit_available() -> str | None:
    """None if nodes can be started here, else the reason they cannot."""
    if not (RABBIT_BIN / "rabbitmq-server").exists():
        return f"{RABBIT_BIN}/rabbitmq-server not found (RabbitMQ is not installed)"
    if shutil.which("erl") is None:
        return "erl (Erlang) not found"
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_pair_free(port: int, host: str = "127.0.0.1") -> bool:
    """A node could use AMQP ``port``: it and its distribution port are both free."""
    for candidate in (port, port + DIST_PORT_OFFSET):
        with socket.socket() as s:
            try:
                s.bind((host, candidate))
            except OSError:
                return False
    return True


@dataclass
class RabbitNode:
    """One rabbitmq-server process: ``name@host``, AMQP on ``port``."""

    base: Path
    name: str
    port: int
    host: str = "localhost"
    listen: str = "127.0.0.1"
    extra_config: str = ""
    netns: str | None = None  # run inside this network namespace
    cookie: str = "shardserve-test-cookie"
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def nodename(self) -> str:
        return f"{self.name}@{self.host}"

    @property
    def folder(self) -> Path:
        return self.base / self.name

    @property
    def dist_port(self) -> int:
        return self.port + DIST_PORT_OFFSET

    def url(self, user: str = "guest", password: str = "guest") -> str:
        return f"amqp://{user}:{password}@{self.listen}:{self.port}/"

    def env(self) -> dict[str, str]:
        home = self.base / "home"
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_NODE_IP_ADDRESS": self.listen,
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.folder / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.folder / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.folder / "rabbitmq"),
            "RABBITMQ_CONF_ENV_FILE": str(self.folder / "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.folder / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(self.folder / "pid"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }

    def _prepare(self) -> None:
        home = self.base / "home"
        home.mkdir(parents=True, exist_ok=True)
        cookie = home / ".erlang.cookie"
        if not cookie.exists():
            cookie.write_text(self.cookie)
            cookie.chmod(0o400)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "rabbitmq-env.conf").write_text("")
        (self.folder / "enabled_plugins").write_text("[].\n")
        config = [
            f"listeners.tcp.default = {self.listen}:{self.port}",
            "loopback_users = none",
            "log.console = false",
            "log.file.level = warning",
            self.extra_config,
        ]
        (self.folder / "rabbitmq.conf").write_text("\n".join(config) + "\n")

    def _wrap(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else argv

    def start(self, wait: bool = True) -> None:
        self._prepare()
        # The server keeps its own copy of the descriptor; ours is closed at once.
        with (self.folder / "server.out").open("ab") as log:
            self.proc = subprocess.Popen(
                self._wrap([str(RABBIT_BIN / "rabbitmq-server")]),
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        if wait:
            self.wait_started()

    def wait_started(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise NodeError(f"{self.nodename} exited early:\n{self.log_tail()}")
            try:
                done = self.ctl("await_startup", "--timeout", "10", check=False, timeout=40)
            except subprocess.TimeoutExpired:
                continue  # the CLI itself is slow to start on a busy machine
            if done.returncode == 0:
                return
            time.sleep(0.5)
        raise NodeError(f"{self.nodename} did not start in {timeout:g}s:\n{self.log_tail()}")

    def ctl(
        self, *args: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        argv = self._wrap([str(RABBIT_BIN / "rabbitmqctl"), "-n", self.nodename, *args])
        done = subprocess.run(
            argv, env=self.env(), capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise NodeError(f"rabbitmqctl {' '.join(args)} on {self.nodename}: {done.stderr}")
        return done

    def stop(self) -> None:
        """Stop the node (rabbitmqctl stop, then kill the process group if needed)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:  # a loaded host may not answer rabbitmqctl in time: then kill it
                self.ctl("stop", check=False, timeout=30)
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        texts = []
        for path in [self.folder / "server.out", *sorted((self.folder / "log").glob("*.log"))]:
            if path.exists():
                texts.extend(path.read_text(errors="replace").splitlines()[-lines:])
        return "\n".join(texts[-lines:])
