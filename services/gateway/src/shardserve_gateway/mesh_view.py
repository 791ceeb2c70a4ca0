"""The gateway's view of the mesh: the latest ``MeshStatus`` broadcast by the scheduler.

Readiness, model metadata and request validation all read this view; nothing asks the
scheduler synchronously. A status counts as fresh for ``stale_after_s`` (3 s) after it
*arrived* here: ages are measured on this process's monotonic clock, so clock skew
between hosts cannot make a live scheduler look dead (the status queue is created by
this gateway, so nothing old is waiting in it at start).

Model names: the KServe model ``<servable>`` means the servable's default method
(``predict``, or its first method when it has no ``predict``); ``<servable>:<method>``
names any other method (see ``kserve`` for why).

The view also tracks which scheduler is active (``MeshStatus.scheduler`` and
``SchedulerHello``) and tells its listeners when that changes: the dispatcher fails
requests the previous scheduler had taken.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from aio_pika.abc import AbstractIncomingMessage

from shardserve.amqp.broker import Broker
from shardserve.errors import BadInputError, NotFoundError, UnavailableError
from shardserve.process.waits import set_within
from shardserve.wire import topology
from shardserve.wire.protocol import (
    MeshStatus,
    Message,
    MethodStatus,
    SchedulerHello,
    ServableStatus,
)

_logger = logging.getLogger(__name__)

DEFAULT_METHOD = "predict"
METHOD_SEPARATOR = ":"
STATUS_PREFETCH = 16
BROKER_NOT_CONNECTED = "broker not connected yet"


@dataclass(frozen=True)
class Target:
    """A resolved servable version and method: what a request will run."""

    servable: ServableStatus
    method: MethodStatus

    @property
    def model_name(self) -> str:
        """The KServe model name of this target (method suffix only when not the default)."""
        if self.method.name == default_method(self.servable).name:
            return self.servable.name
        return f"{self.servable.name}{METHOD_SEPARATOR}{self.method.name}"


def split_model_name(model: str) -> tuple[str, str | None]:
    """``"s:m"`` -> ``("s", "m")``; ``"s"`` -> ``("s", None)`` (default method)."""
    servable, sep, method = model.rpartition(METHOD_SEPARATOR)
    if not sep:
        return model, None
    return servable, method


def default_method(servable: ServableStatus) -> MethodStatus:
    """``predict`` when declared, else the first declared method."""
    for method in servable.methods:
        if method.name == DEFAULT_METHOD:
            return method
    if not servable.methods and servable.generation:
        raise BadInputError(
            f"servable {servable.name!r} is a text-generation servable: use /v1/completions, "
            f"/v1/chat/completions or /v2/models/{servable.name}/generate"
        )
    if not servable.methods:
        raise NotFoundError(f"servable {servable.name!r} declares no methods")
    return servable.methods[0]


class MeshView:
    """Holds the latest MeshStatus and answers lookups against it."""

    def __init__(self, stale_after_s: float = 3.0, clock: Callable[[], float] = time.monotonic):
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._status: MeshStatus | None = None
        self._received_at = 0.0
        self._scheduler: str | None = None
        self._scheduler_listeners: list[Callable[[str], None]] = []
        self._first_status = asyncio.Event()
        self.draining = False
        # Until the gateway's first broker connection (it waits for a broker): a status
        # cannot have come, and the reason is the broker, not the scheduler.
        self.waiting_for_broker = False

    def add_scheduler_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(scheduler_id)`` whenever a different scheduler shows up."""
        self._scheduler_listeners.append(listener)

    def update(self, status: MeshStatus) -> None:
        """Record a status broadcast that just arrived."""
        self._status = status
        self._received_at = self._clock()
        self._first_status.set()
        self.scheduler_seen(status.scheduler)

    async def wait_first_status(self, timeout_s: float) -> bool:
        """Wait (bounded) until a status has arrived; False if none came in time."""
        return await set_within(self._first_status, timeout_s)

    def scheduler_seen(self, scheduler: str) -> None:
        """A message from ``scheduler`` arrived; tell the listeners if it is a new one."""
        if scheduler == self._scheduler:
            return
        self._scheduler = scheduler
        for listener in self._scheduler_listeners:
            listener(scheduler)

    @property
    def scheduler(self) -> str | None:
        """The id of the scheduler seen last (None before any)."""
        return self._scheduler

    @property
    def status(self) -> MeshStatus | None:
        """The latest status, fresh or not."""
        return self._status

    def age_s(self) -> float | None:
        """Seconds since the latest status arrived (None before the first)."""
        if self._status is None:
            return None
        return max(0.0, self._clock() - self._received_at)

    def fresh(self) -> bool:
        """Whether the latest status is younger than the staleness limit."""
        age = self.age_s()
        return age is not None and age < self._stale_after_s

    def require_fresh(self) -> MeshStatus:
        """The latest status, or UnavailableError saying why there is none to trust."""
        if self.waiting_for_broker:
            raise UnavailableError(BROKER_NOT_CONNECTED)
        age = self.age_s()
        if self._status is None or age is None:
            raise UnavailableError("no scheduler status received yet (is the scheduler running?)")
        if age >= self._stale_after_s:
            raise UnavailableError(f"scheduler status is stale (last seen {age:.1f} s ago)")
        return self._status

    def not_ready_reasons(self) -> list[str]:
        """Why the server is not ready; empty when every servable version is ready."""
        if self.draining:
            return ["gateway is draining (shutting down)"]
        try:
            status = self.require_fresh()
        except UnavailableError as exc:
            return [exc.message]
        return [
            f"servable {s.name!r} version {s.version} is not ready"
            + (f": {s.reason}" if s.reason else "")
            for s in status.servables
            if not s.ready
        ]

    def versions_of(self, servable: str) -> list[ServableStatus]:
        """Every known version of a servable, lowest first (fresh status required)."""
        status = self.require_fresh()
        found = sorted((s for s in status.servables if s.name == servable), key=lambda s: s.version)
        if not found:
            raise NotFoundError(f"unknown model {servable!r}")
        return found

    def find_servable(self, servable: str, version: int = 0) -> ServableStatus:
        """A servable version; version 0 = the highest ready one (else the highest)."""
        versions = self.versions_of(servable)
        if version == 0:
            ready = [s for s in versions if s.ready]
            return (ready or versions)[-1]
        for s in versions:
            if s.version == version:
                return s
        known = [s.version for s in versions]
        raise NotFoundError(f"unknown version {version} of model {servable!r}; known: {known}")

    def resolve(self, model: str, version: int = 0) -> Target:
        """Resolve a KServe model name (``servable[:method]``) and version to a target."""
        servable_name, method_name = split_model_name(model)
        servable = self.find_servable(servable_name, version)
        if method_name is None:
            return Target(servable, default_method(servable))
        return Target(servable, find_method(servable, method_name))


def find_method(servable: ServableStatus, name: str) -> MethodStatus:
    """A method of a servable version, or NotFoundError listing the methods it has."""
    for method in servable.methods:
        if method.name == name:
            return method
    names = [m.name for m in servable.methods]
    raise NotFoundError(f"unknown method {name!r} of model {servable.name!r}; methods: {names}")


def require_ready(servable: ServableStatus) -> None:
    """Raise UnavailableError (503) naming why a servable version cannot take requests."""
    if not servable.ready:
        reason = f": {servable.reason}" if servable.reason else ""
        raise UnavailableError(
            f"model {servable.name!r} version {servable.version} is not ready{reason}"
        )


def on_status_message(view: MeshView, message: Message) -> None:
    """Feed one message of the status queue into the view."""
    if isinstance(message, MeshStatus):
        view.update(message)
    elif isinstance(message, SchedulerHello):
        _logger.info("scheduler %s started", message.scheduler)
        view.scheduler_seen(message.scheduler)


async def consume_status(broker: Broker, view: MeshView, owner: str) -> None:
    """Declare this gateway's status queue and feed every MeshStatus into the view."""

    async def on_status(message: Message, _incoming: AbstractIncomingMessage) -> None:
        on_status_message(view, message)

    queue = topology.status_queue(owner)
    await broker.declare(queue, topology.status_bindings(owner))
    await broker.consume(queue.name, on_status, prefetch=STATUS_PREFETCH)
