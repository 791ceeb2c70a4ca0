"""Generation faults through a real mesh: `shardserve up --schedulers 2` serving the llama
fixture at TP 2 and the matmul demo side by side.

SIGKILL a rank mid-generation: its streams end with an error event within the heartbeat
timeout (never a hang, never a 200 with a cut text and no error), the matmul servable
keeps serving, /v2/health/ready and the status page turn unready, the group heals and new
requests give the greedy text again. SIGKILL the active scheduler: running streams end
with a clear error, the standby serves new ones, and no rank keeps KV for a sequence the
lost scheduler owned.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from shardserve.errors import ErrorCode
from shardserve.ops.child_mesh import LocalMesh, http_get
from shardserve.ops.launch.plan import HEARTBEAT_TIMEOUT_S
from shardserve.tools.export.hf import export_hf
from shardserve.tools.export.matmul import export_matmul

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from generation_http import (
    FIXTURE,
    REFERENCE,
    idle,
    servable_status,
    sse_events,
    start_mesh,
    wait_for,
)
from loadcheck import all_close, infer_body, one_request

pytestmark = pytest.mark.integration

LLAMA = "llama_tp2"
MATMUL = "matmul"
PROMPT = REFERENCE["prompts"][0]
# The rank is declared lost after the heartbeat timeout; allow for the status interval
# and the way back to the client.
ERROR_WITHIN_S = HEARTBEAT_TIMEOUT_S + 2.0
STREAMS = 3


@pytest.fixture(scope="module")
def mesh(isolated_amqp_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    repo = tmp_path_factory.mktemp("repo")
    export_hf(FIXTURE, repo, rank_size=2, name=LLAMA)
    export_matmul(repo, rank_size=2, name=MATMUL)
    log = tmp_path_factory.mktemp("mesh") / "mesh.log"
    mesh = start_mesh(repo, isolated_amqp_url, log, ("--schedulers", "2"))
    try:
        yield mesh
    finally:
        mesh.stop()


@dataclass
class SseStream:
    """One streamed /v1/completions: its events and when it ended."""

    events: list[dict[str, Any] | str] = field(default_factory=list)
    ended_at: float = 0.0

    @property
    def done(self) -> bool:
        return "[DONE]" in self.events

    @property
    def error(self) -> dict[str, Any] | None:
        last = self.events[-1] if self.events else None
        return last["error"] if isinstance(last, dict) and "error" in last else None


async def start_stream(
    session: aiohttp.ClientSession, mesh: LocalMesh, prompt: str
) -> tuple[SseStream, asyncio.Task[None]]:
    """A long greedy stream, returned once its first event has arrived (it is running)."""
    body = {"model": LLAMA, "prompt": prompt, "max_tokens": 100, "stream": True}
    response = await session.post(
        mesh.http_url + "/v1/completions", json=body | {"ignore_eos": True}
    )
    assert response.status == 200, await response.text()
    stream, events = SseStream(), sse_events(response)
    stream.events.append(await anext(events))

    async def rest() -> None:
        async with response:
            stream.events += [event async for event in events]
        stream.ended_at = time.monotonic()

    return stream, asyncio.create_task(rest())


async def greedy_text(session: aiohttp.ClientSession, mesh: LocalMesh) -> str:
    body = {
        "model": LLAMA,
        "prompt": PROMPT["text"],
        "max_tokens": len(PROMPT["greedy_ids"]),
        "temperature": 0.0,
        "ignore_eos": True,
    }
    async with session.post(mesh.http_url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return str((await response.json())["choices"][0]["text"])


def matmul_serves(mesh: LocalMesh) -> bool:
    url = f"{mesh.http_url}/v2/models/{MATMUL}/infer"
    outcome = one_request(url, infer_body([128, 96]), all_close(-48.0), 10.0)
    return outcome == ("ok", "")


def unready(mesh: LocalMesh) -> bool:
    """Health says not ready, and the status page says the llama servable is not ready."""
    return http_get(mesh.http_url + "/v2/health/ready")[0] != 200 and not servable_status(
        mesh, LLAMA
    ).get("ready", True)


def ready(mesh: LocalMesh) -> bool:
    return http_get(mesh.http_url + "/v2/health/ready")[0] == 200 and bool(
        servable_status(mesh, LLAMA).get("ready")
    )


@dataclass
class Loss:
    """What a watch saw after the kill."""

    unready_after_s: float | None = None
    ready_after_s: float | None = None
    matmul: list[bool] = field(default_factory=list)  # requests made while it was unready


def watch_unready(mesh: LocalMesh, since: float, seconds: float, loss: Loss) -> None:
    while (now := time.monotonic()) < since + seconds:
        if unready(mesh):
            loss.unready_after_s = now - since
            loss.matmul += [matmul_serves(mesh) for _ in range(3)]
            return
        time.sleep(0.05)


def watch_heal(mesh: LocalMesh, since: float, seconds: float, loss: Loss) -> None:
    while (now := time.monotonic()) < since + seconds:
        if ready(mesh):
            loss.ready_after_s = now - since
            return
        time.sleep(0.05)


@contextlib.contextmanager
def restarts_paused(mesh: LocalMesh) -> Iterator[None]:
    """SIGSTOP the launcher (its children run on, in their own process groups): a killed
    agent is not restarted until the block ends, so the loss lasts long enough to be seen
    on a busy machine (a restart is otherwise back within a second of the loss)."""
    assert mesh.proc is not None
    os.kill(mesh.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(mesh.proc.pid, signal.SIGCONT)


def assert_ended_with_error(stream: SseStream, code: ErrorCode, since: float) -> None:
    """An error event last, no [DONE], within ERROR_WITHIN_S of ``since``."""
    assert stream.error is not None, f"no error event: {stream.events[-3:]}"
    assert stream.error["code"] == code, stream.error
    assert not stream.done, "a failed stream also said [DONE]"
    took = stream.ended_at - since
    assert took < ERROR_WITHIN_S, f"the error came {took:.1f} s after the fault"


async def test_rank_killed_mid_generation_ends_its_streams_and_the_group_heals(
    mesh: LocalMesh,
) -> None:
    victim = mesh.rank_pid(LLAMA, 1)
    async with aiohttp.ClientSession() as session:
        started = [await start_stream(session, mesh, f"Story {i}:") for i in range(STREAMS)]
        loss = Loss()
        with restarts_paused(mesh):
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            watch = asyncio.to_thread(watch_unready, mesh, killed_at, 20.0, loss)
            await asyncio.wait_for(asyncio.gather(*(task for _, task in started), watch), 30.0)
        await asyncio.to_thread(watch_heal, mesh, killed_at, 60.0, loss)
        for stream, _ in started:
            assert_ended_with_error(stream, ErrorCode.RANK_LOST, killed_at)
            assert "rank 1" in stream.error["message"], stream.error  # type: ignore[index]
        assert loss.unready_after_s is not None, "health and status stayed ready"
        assert loss.matmul and all(loss.matmul), f"matmul while the rank was lost: {loss}"
        assert loss.ready_after_s is not None, f"the group did not heal:\n{mesh.log_tail()}"
        assert mesh.rank_pid(LLAMA, 1) != victim
        assert await greedy_text(session, mesh) == PROMPT["greedy_text"]
    errors_after = max(s.ended_at for s, _ in started) - killed_at
    print(f"rank kill: error events after {errors_after:.2f} s, {loss}")


def active_scheduler_pid(mesh: LocalMesh) -> tuple[str, int]:
    scheduler = str(mesh.status()["scheduler"])
    return scheduler, int(scheduler.rsplit("-", 2)[1])  # "<host>-<pid>-<random>"


def new_scheduler_ready(mesh: LocalMesh, old: str) -> bool:
    code, status = mesh.get("/api/status")
    new = code == 200 and status.get("scheduler") not in (None, old) and status.get("fresh")
    return bool(new) and all(s.get("ready") for s in status.get("servables", ()))


async def test_scheduler_killed_with_a_standby_ends_streams_and_serves_new_ones(
    mesh: LocalMesh,
) -> None:
    assert wait_for(lambda: ready(mesh), 30.0), mesh.log_tail()
    old, pid = active_scheduler_pid(mesh)
    async with aiohttp.ClientSession() as session:
        started = [await start_stream(session, mesh, f"Tale {i}:") for i in range(STREAMS)]
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(task for _, task in started)), 30.0)
        for stream, _ in started:
            assert stream.error is not None, f"no error event: {stream.events[-3:]}"
            assert stream.error["code"] == ErrorCode.UNAVAILABLE, stream.error
            assert "scheduler" in stream.error["message"], stream.error
            assert not stream.done
        took = max(s.ended_at for s, _ in started) - killed_at
        took_over = await asyncio.to_thread(wait_for, lambda: new_scheduler_ready(mesh, old), 60)
        assert took_over, f"no standby took over:\n{mesh.log_tail()}"
        assert await greedy_text(session, mesh) == PROMPT["greedy_text"]
    print(f"scheduler kill -> error events within {took:.2f} s")
    # The lost scheduler's sequences must not keep KV on the ranks forever.
    freed = await asyncio.to_thread(wait_for, lambda: idle(mesh, LLAMA), 15.0)
    assert freed, f"KV still held after the scheduler was replaced: {mesh.ranks(LLAMA)}"
