"""A pure test bench for the GenerationMachine: a generation group, a registry whose ranks
report KV budgets, the llama fixture's real tokenizer, and a scripted mesh that answers
StepWork (hidden states passed through; the last stage's leader "samples" scripted tokens;
a decode run's iterations are streamed by the leader, then every rank answers the last).
No tests here: the test_generation_* modules import it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from shardserve.repo.repository import AllGatherOp, GroupConfig, RankSpec, RunOp, StageSpec
from shardserve.text.tokenizer import TextModel
from shardserve.wire.protocol import (
    AgentHeartbeat,
    AgentHello,
    ErrorInfo,
    GenerateChunk,
    GenerateRequest,
    SamplingParams,
    StepResult,
    StepWork,
    TensorSpec,
)
from shardserve.wire.tensors import Tensor, digest_tensors
from shardserve_scheduler.core.actions import Action, PublishFree, PublishStep, SendChunk
from shardserve_scheduler.core.generation.machine import GenerationMachine
from shardserve_scheduler.core.generation.resolve import Target
from shardserve_scheduler.core.generation.sequences import Origin
from shardserve_scheduler.core.generation.state import Limits
from shardserve_scheduler.core.registry import Registry

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "hf" / "llama"
SERVABLE = "llama"
BYTES_PER_TOKEN = 100
_TEXT: list[TextModel] = []

Script = Callable[[int, int], int]  # (sequence id, generated index) -> token


def text_model() -> TextModel:
    if not _TEXT:
        _TEXT.append(TextModel.load(FIXTURE, SERVABLE, 512))
    return _TEXT[0]


def group(stage_size: int = 1, per_stage: int = 2, final_gather: bool = False) -> GroupConfig:
    io = ("input_ids", "positions", "logit_rows")
    hidden = ("hidden", "positions", "logit_rows")
    last_program: tuple[Any, ...] = (RunOp(file="seg.onnx"),)
    if final_gather:
        last_program += (AllGatherOp(input="part", output="logits", axis=1),)
    stages = tuple(
        StageSpec(
            index=s,
            ranks=tuple(range(s * per_stage, (s + 1) * per_stage)),
            inputs=io if s == 0 else hidden,
            outputs=("logits",) if s == stage_size - 1 else hidden,
            program=last_program if s == stage_size - 1 else (RunOp(file="seg.onnx"),),
        )
        for s in range(stage_size)
    )
    ranks = tuple(
        RankSpec(rank=r, stage=r // per_stage, files={"seg.onnx": f"{r:064x}"}, checksum=f"c{r}")
        for r in range(stage_size * per_stage)
    )
    spec = TensorSpec(name="input_ids", datatype="INT64", shape=(-1,))
    return GroupConfig(
        servable=SERVABLE,
        version=1,
        rank_size=stage_size * per_stage,
        stage_size=stage_size,
        inputs=(spec,),
        outputs=(TensorSpec(name="logits", datatype="FP32", shape=(-1, 512)),),
        stages=stages,
        ranks=ranks,
        origin={"task": "text-generation", "max_positions": 128, "vocab": 512},
    )


def registry(config: GroupConfig, kv_tokens: int = 10_000, now: float = 0.0) -> Registry:
    reg = Registry.build([config], now, heartbeat_timeout=3.0)
    for spec in config.ranks:
        fields: dict[str, Any] = dict(
            instance=f"agent-{spec.rank}",
            servable=config.servable,
            version=config.version,
            rank=spec.rank,
            stage=spec.stage,
            slice_checksum=spec.checksum,
            kv_capacity_bytes=kv_tokens * BYTES_PER_TOKEN,
            kv_bytes_per_token=BYTES_PER_TOKEN,
        )
        assert reg.hello(AgentHello(**fields), now).accepted
        assert reg.heartbeat(AgentHeartbeat(**fields), now)
    return reg


def request(
    rid: str = "r1", prompt_ids: tuple[int, ...] = (0, 5, 6, 7), deadline: float = 1000.0, **kw: Any
) -> GenerateRequest:
    kw.setdefault("temperature", 0.0)
    return GenerateRequest(
        id=rid,
        servable=SERVABLE,
        prompt_ids=prompt_ids,
        sampling=SamplingParams(**kw),
        deadline=deadline,
    )


class Bench:
    """A machine, its group, and the chunks and messages it produced so far."""

    def __init__(
        self,
        stage_size: int = 1,
        kv_tokens: int = 10_000,
        limits: Limits | None = None,
        script: Script | None = None,
        final_gather: bool = False,
    ) -> None:
        self.group = group(stage_size, final_gather=final_gather)
        self.registry = registry(self.group, kv_tokens)
        self.machine = GenerationMachine(
            self.registry, result_to="results.q", id_prefix="t", limits=limits, seeds=lambda: 7
        )
        self.script: Script = script or (lambda seq, index: 100 + index)
        self.broken: set[tuple[int, int]] = set()  # (sequence, index): a non-finite logit row
        self.chunks: dict[str, list[GenerateChunk]] = {}
        self.steps: list[StepWork] = []  # every StepWork published, in order
        self.frees: list[PublishFree] = []
        self.pending: list[StepWork] = []  # published, not answered yet
        self.now = 0.0

    def take(self, actions: list[Action]) -> list[Action]:
        for action in actions:
            if isinstance(action, SendChunk):
                self.chunks.setdefault(action.correlation_id, []).append(action.chunk)
            elif isinstance(action, PublishStep):
                self.steps.append(action.work)
                self.pending.append(action.work)
            elif isinstance(action, PublishFree):
                self.frees.append(action)
        return actions

    def generate(self, corr: str, req: GenerateRequest | None = None) -> list[Action]:
        req = req or request(corr)
        assert req.prompt_ids is not None
        origin = Origin(req, "reply.q", corr)
        target = Target(self.group, text_model(), tuple(req.prompt_ids), 128)
        return self.take(self.machine.on_generate(origin, target, self.now))

    def answer(self, work: StepWork, error: ErrorInfo | None = None) -> list[Action]:
        """Every rank of the work's stage answers (scripted outputs); returns the actions.
        A decode run: the leader streams its iterations but the last, then every rank
        answers the last."""
        self.pending.remove(work)
        actions: list[Action] = []
        for iteration in range(work.decode_steps - 1):
            actions += self.machine.on_step_result(self.streamed(work, iteration), self.now)
        for rank in self.group.stages[work.stage].ranks:
            result = self.result(work, rank, error if rank == work.stage * 2 else None)
            if result is not None:
                actions += self.machine.on_step_result(result, self.now)
        return self.take(actions)

    def streamed(self, work: StepWork, iteration: int) -> StepResult:
        """The leader's result of a decode run's iteration (not the last)."""
        tokens = tuple(self.script(r.seq, r.index + iteration) for r in work.sampling)
        return StepResult(
            step=work.step,
            servable=work.servable,
            version=work.version,
            stage=work.stage,
            rank=self.group.leader_of(work.stage),
            tokens=tokens,
            broken_rows=self.broken_rows(work, iteration),
            iteration=iteration,
        )

    def broken_rows(self, work: StepWork, iteration: int) -> tuple[int, ...]:
        """The rows of ``self.broken`` in the work's ``iteration``."""
        rows = enumerate(work.sampling)
        return tuple(i for i, r in rows if (r.seq, r.index + iteration) in self.broken)

    def result(self, work: StepWork, rank: int, error: ErrorInfo | None) -> StepResult | None:
        base = dict(step=work.step, servable=work.servable, version=work.version)
        base |= dict(stage=work.stage, rank=rank)
        if error is not None:
            return StepResult(**base, error=error)
        if work.decode_steps > 1:  # every rank answers the last iteration of a run
            last = work.decode_steps - 1
            leader = rank == self.group.leader_of(work.stage)
            tokens = tuple(self.script(r.seq, r.index + last) for r in work.sampling)
            broken = self.broken_rows(work, last) if leader else ()
            return StepResult(
                **base,
                digest="d",
                tokens=tokens if leader else (),
                broken_rows=broken,
                iteration=last,
            )
        leader = self.group.leader_of(work.stage)
        last = work.stage == self.group.stage_size - 1
        if not last:
            outputs = {
                "hidden": Tensor.from_numpy(work.inputs["positions"].to_numpy().astype(np.float32)),
                "positions": work.inputs["positions"],
                "logit_rows": work.inputs["logit_rows"],
            }
            digest = digest_tensors(outputs)
            return StepResult(**base, digest=digest, outputs=outputs if rank == leader else None)
        if rank != leader and self.group.stages[work.stage].program[-1].op == "allgather":
            return None  # combined at the leader: non-leaders send nothing
        tokens = tuple(self.script(r.seq, r.index) for r in work.sampling)
        if rank != leader:
            return StepResult(**base, digest="d")
        return StepResult(**base, digest="d", tokens=tokens, broken_rows=self.broken_rows(work, 0))

    def run_step(self) -> list[Action]:
        """Answer the oldest pending StepWork."""
        return self.answer(self.pending[0])

    def run_until_idle(self, limit: int = 1000) -> None:
        for _ in range(limit):
            if not self.pending:
                return
            self.run_step()
        raise AssertionError("the machine never went idle")

    def text(self, corr: str) -> str:
        return "".join(c.text for c in self.chunks[corr])

    def last(self, corr: str) -> GenerateChunk:
        chunks = self.chunks[corr]
        assert chunks[-1].last and all(not c.last for c in chunks[:-1]), chunks
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        return chunks[-1]
