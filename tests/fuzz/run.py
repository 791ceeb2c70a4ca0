"""One fuzz run: start a matmul mesh, fuzz its HTTP routes and AMQP consumers, check it.

Passed when no answer was >= 500 or missing, every bad message sent to a dead-lettering
consumer came back on the dead-letter queue, every service process that was there at the
start is still there (same pids: a restart is a crash), and the demo request still
answers -48 everywhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import requests
from tests.fuzz import amqp_fuzz, amqp_messages, generation_fuzz, grpc_fuzz, http_fuzz
from tests.fuzz.oip_spec import OIP_GENERATE_SPEC, OIP_SPEC, load_oip_spec
from tests.fuzz.tally import HttpTally

from shardserve.ops.chaos.target import ChaosMesh

SERVICES = ("scheduler", "gateway", "agent")
DEMO_ELEMENT = -48.0
# The mesh's services give up an incomplete chunked message (and dead-letter its chunks)
# after this, not 120 s: well within the wait for dead letters (``fuzz_amqp``), so the
# lone fragments among the bad messages come back as dead letters too.
CHUNK_EXPIRY_ENV, CHUNK_EXPIRY_S = "SHARDSERVE_CHUNK_EXPIRY", "5"
# The generation servable the fuzz reaches: the exported llama fixture at TP 2.
HF_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "llama"
GENERATION_SERVABLE = "llama_tp2"
GENERATION_KINDS = ("generate.request", "generate.cancel")
RANK_LOST_LINE = "no heartbeat for"


@dataclass
class FuzzRun:
    http: list[HttpTally] = field(default_factory=list)
    amqp: amqp_fuzz.AmqpTally | None = None
    amqp_generation: amqp_fuzz.AmqpTally | None = None
    streams: generation_fuzz.WellFormedStreams | None = None
    grpc: grpc_fuzz.GrpcFuzzResult | None = None
    ranks_lost: int = 0  # "no heartbeat" losses in the mesh log
    pids_before: dict[str, list[int]] = field(default_factory=dict)
    pids_lost: list[str] = field(default_factory=list)
    demo_ok: bool = False
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        amqp_ok = all(t is None or t.passed for t in (self.amqp, self.amqp_generation))
        fuzzed = (self.http or self.amqp or self.grpc) and all(t.passed for t in self.http)
        streams_ok = self.streams is None or self.streams.passed
        grpc_ok = self.grpc is None or self.grpc.passed
        clean = not self.pids_lost and not self.ranks_lost
        return bool(fuzzed) and amqp_ok and clean and self.demo_ok and streams_ok and grpc_ok

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "http": [t.as_dict() for t in self.http],
            "amqp": None if self.amqp is None else self.amqp.as_dict(),
            "amqp_generation": None
            if self.amqp_generation is None
            else self.amqp_generation.as_dict(),
            "well_formed_streams": None
            if self.streams is None
            else {"right": self.streams.completed, "wrong": self.streams.wrong},
            "grpc": None if self.grpc is None else self.grpc.as_dict(),
            "ranks_lost": self.ranks_lost,
            "services": {k: len(v) for k, v in self.pids_before.items()},
            "services_lost": self.pids_lost,
            "demo_answers_-48": self.demo_ok,
            "seconds": self.seconds,
        }

    def lines(self) -> list[str]:
        alive = sum(len(v) for v in self.pids_before.values()) - len(self.pids_lost)
        total = sum(len(v) for v in self.pids_before.values())
        out = [t.summary() for t in self.http]
        out.append("amqp: not run" if self.amqp is None else self.amqp.summary())
        if self.amqp_generation is not None:
            out.append("generate/cancel " + self.amqp_generation.summary())
        if self.streams is not None:
            out.append(self.streams.summary())
        if self.grpc is not None:
            out.extend(self.grpc.lines())
        out.append(f"ranks declared lost: {self.ranks_lost}")
        out.append(f"services alive {alive}/{total}; demo -48: {self.demo_ok}")
        out.append("seconds " + " ".join(f"{k}:{v:.0f}" for k, v in self.seconds.items()))
        out.append("PASSED" if self.passed else "FAILED")
        return out


def demo_answers(base_url: str) -> bool:
    """The README's request: 200, and every element of y is -48."""
    body = {"inputs": [{"name": "x", "shape": [128, 96], "datatype": "FP32", "data": [1] * 12288}]}
    request = urllib.request.Request(
        base_url + "/v2/models/matmul/infer",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.loads(response.read())
    except OSError:
        return False
    data = answer["outputs"][0]["data"]
    return len(data) == 128 * 16 and all(v == DEMO_ELEMENT for v in data)


def service_pids(mesh: ChaosMesh) -> dict[str, list[int]]:
    assert mesh.mesh is not None
    return {service: sorted(mesh.mesh.service_pids(service)) for service in SERVICES}


def lost_pids(before: dict[str, list[int]], after: dict[str, list[int]]) -> list[str]:
    return [
        f"{service} {pid}"
        for service, pids in before.items()
        for pid in pids
        if pid not in after.get(service, [])
    ]


def fuzz_http(run: FuzzRun, base_url: str, budget: int) -> None:
    target = http_fuzz.Target(base_url, ("matmul",), requests.Session())
    gateway = http_fuzz.gateway_spec(base_url)
    sources = (
        ("gateway-openapi", gateway, http_fuzz.fuzz_spec, 0.40),
        ("oip-spec", load_oip_spec(OIP_SPEC), http_fuzz.fuzz_spec, 0.25),
        ("oip-generate-spec", load_oip_spec(OIP_GENERATE_SPEC), http_fuzz.fuzz_spec, 0.15),
        ("stateful-links", gateway, http_fuzz.fuzz_stateful, 0.20),
    )
    for source, spec, fuzz, share in sources:
        tally = HttpTally(source)
        started = time.monotonic()
        fuzz(spec, target, tally, max(1, int(budget * share)))
        run.seconds[f"http-{source}"] = time.monotonic() - started
        run.http.append(tally)
        print(tally.summary(), file=sys.stderr, flush=True)


def fuzz_generation(run: FuzzRun, mesh: ChaosMesh, per_route: int) -> None:
    """Each generation route ``per_route`` times (the four at once: a request mostly waits
    for the mesh), then ``per_route`` malformed generate/cancel messages, a well-formed
    stream after another running throughout."""
    reference = json.loads((HF_FIXTURE / "reference.json").read_text())["prompts"][0]
    streams = generation_fuzz.WellFormedStreams(
        mesh.http_url,
        GENERATION_SERVABLE,
        reference["text"],
        reference["greedy_text"],
        len(reference["greedy_ids"]),
    )
    beside = threading.Thread(target=streams.run, name="well-formed-streams")
    beside.start()
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(len(generation_fuzz.ROUTES)) as pool:  # (mostly waiting)
            tallies = list(
                pool.map(partial(fuzz_one_route, mesh, per_route), generation_fuzz.ROUTES)
            )
        run.seconds["generation-routes"] = time.monotonic() - started
        run.http += tallies
        fuzz_amqp_generation(run, mesh, per_route)
    finally:
        streams.stop.set()
        beside.join()
    run.streams = streams
    print(streams.summary(), file=sys.stderr, flush=True)


def fuzz_one_route(mesh: ChaosMesh, count: int, route: str) -> HttpTally:
    tally = HttpTally(f"generation-{route}")
    generation_fuzz.fuzz_route(mesh.http_url, GENERATION_SERVABLE, route, tally, count)
    print(tally.summary(), file=sys.stderr, flush=True)
    return tally


def fuzz_amqp_generation(run: FuzzRun, mesh: ChaosMesh, count: int) -> None:
    """Malformed GenerateRequests and GenerateCancels into the request queue."""
    messages = amqp_messages.generate(count, kinds=GENERATION_KINDS)
    started = time.monotonic()
    run.amqp_generation = asyncio.run(
        amqp_fuzz.run_amqp_fuzz(
            mesh.amqp_url, mesh.vhost or "/", messages, 30.0 + count / 500, roles=("request",)
        )
    )
    run.seconds["amqp-generation"] = time.monotonic() - started
    print("generate/cancel " + run.amqp_generation.summary(), file=sys.stderr, flush=True)


def fuzz_amqp(run: FuzzRun, mesh: ChaosMesh, count: int) -> None:
    started = time.monotonic()
    messages = amqp_messages.generate(count)
    run.seconds["amqp-generate"] = time.monotonic() - started
    vhost = mesh.vhost or "/"
    started = time.monotonic()
    settle_s = 30.0 + count / 500
    run.amqp = asyncio.run(amqp_fuzz.run_amqp_fuzz(mesh.amqp_url, vhost, messages, settle_s))
    run.seconds["amqp-publish-settle"] = time.monotonic() - started
    print(run.amqp.summary(), file=sys.stderr, flush=True)


def fuzz_grpc(
    run: FuzzRun, mesh: ChaosMesh, workdir: Path, count: int, generation_model: str | None
) -> None:
    """``count`` calls to the gRPC API of a gateway of their own on the mesh (a third of
    them generation requests when the mesh serves ``generation_model``)."""
    started = time.monotonic()
    run.grpc = grpc_fuzz.run_grpc_fuzz(mesh.amqp_url, workdir, count, generation_model)
    run.seconds["grpc"] = time.monotonic() - started
    print("\n".join(run.grpc.lines()), file=sys.stderr, flush=True)


def run_fuzz(
    workdir: Path,
    http_budget: int,
    amqp_count: int,
    ranks: int,
    generation: int = 0,
    grpc: int = 0,
) -> FuzzRun:
    """``generation``: requests per generation route and malformed generate/cancel
    messages (0: no generation servable, none sent); ``grpc``: gRPC calls (0: none)."""
    run = FuzzRun()
    served = {GENERATION_SERVABLE: HF_FIXTURE} if generation > 0 else {}
    mesh = ChaosMesh(workdir, ranks=ranks, hf_checkpoints=served)
    try:
        started = time.monotonic()
        with mock.patch.dict(os.environ, {CHUNK_EXPIRY_ENV: CHUNK_EXPIRY_S}):
            mesh.start()  # (its processes take the environment as it is now)
        assert mesh.mesh is not None
        mesh.mesh.wait_ready()
        run.seconds["mesh-start"] = time.monotonic() - started
        run.pids_before = service_pids(mesh)
        if http_budget > 0:
            fuzz_http(run, mesh.http_url, http_budget)
        if generation > 0:
            fuzz_generation(run, mesh, generation)
        if amqp_count > 0:
            fuzz_amqp(run, mesh, amqp_count)
        if grpc > 0:
            fuzz_grpc(run, mesh, workdir, grpc, GENERATION_SERVABLE if served else None)
        run.pids_lost = lost_pids(run.pids_before, service_pids(mesh))
        run.ranks_lost = mesh.log_path.read_text(errors="replace").count(RANK_LOST_LINE)
        run.demo_ok = demo_answers(mesh.http_url)
    finally:
        mesh.stop()
        mesh.cleanup()
    return run
