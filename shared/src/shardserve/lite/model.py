"""``lite.Model``: build one rank's slice, then predict with its peers (MindSpore Lite's flow).

::

    context = lite.Context(rank_id=0)
    model = lite.Model()
    model.build_from_file("models/matmul/1", context, "config.ini")
    inputs = model.get_inputs()
    inputs[0].set_data_from_numpy(np.ones((128, 96), np.float32))
    outputs = model.predict(inputs)

``build_from_file`` verifies and compiles the rank's slice (through the compile cache)
and, when the group has more than one rank, joins the run's other ranks over RabbitMQ
(see ``shardserve.lite.wire``). Every rank is given the same input; ranks of stage 0
compute from it, ranks of later stages from the previous stage's output. ``predict``
returns the rank's stage outputs (the model's outputs on the last stage).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from shardserve.amqp.collective import JobCancelledError
from shardserve.lite.config import RunConfig, load_config
from shardserve.lite.context import Context
from shardserve.lite.errors import LiteError, PeerFailedError
from shardserve.lite.loop import LoopThread
from shardserve.lite.slice import SliceLocation, load_version, locate, open_slice
from shardserve.lite.tensor import Tensor
from shardserve.lite.wire import RunMesh
from shardserve.repo.repository import GroupConfig, StageSpec
from shardserve.runtime.compile_cache import (
    CacheStatus,
    CompileCache,
    SessionConfig,
    default_cache_dir,
)
from shardserve.runtime.program import (
    Collective,
    Env,
    GatherCollective,
    OrtSegment,
    run_stage,
)

_logger = logging.getLogger(__name__)


class _SoloCollective(GatherCollective):
    """A stage of one rank: every collective is the rank's own tensor."""

    async def gather(self, step: int, array: np.ndarray) -> list[np.ndarray]:
        return [array]


class _Built:
    """Everything ``build_from_file`` made; owned (and closed) by the Model."""

    def __init__(self, group: GroupConfig, rank: int, run: str, loop: LoopThread) -> None:
        self.group = group
        self.rank = rank
        self.run = run
        self.loop = loop
        self.stage: StageSpec = group.stage_of(rank)
        self.runners: dict[str, OrtSegment] = {}
        self.mesh: RunMesh | None = None
        self.predicts = 0


class Model:
    """One rank's slice of a model, built once and run many times."""

    def __init__(self) -> None:
        self._built: _Built | None = None
        self._timeout_s = 0.0
        self.cache_status: CacheStatus = "off"
        self.load_ms = 0.0

    # ------------------------------------------------------------ build

    def build_from_file(
        self, model_path: str | Path, context: Context, config_file: str | Path | None = None
    ) -> None:
        """Load, verify and compile the rank's slice; meet the run's other ranks."""
        if self._built is not None:
            raise LiteError("this model is already built; make a new Model for another slice")
        config = load_config(Path(config_file)) if config_file is not None else RunConfig()
        ctx = context.merged(config)
        location = locate(Path(model_path))
        group = load_version(location)
        rank = _rank(location, ctx)
        cache = _compile_cache(location, group, rank, ctx)
        opened = open_slice(location, group, rank, cache)
        self.cache_status, self.load_ms = opened.cache, opened.load_ms
        run = ctx.resolved_run_id(group.servable, group.version)
        built = _Built(group, rank, run, LoopThread(f"lite-r{rank}"))
        built.runners = opened.runners
        try:
            if group.rank_size > 1:
                built.mesh = RunMesh(ctx.broker_settings(), built.run, group, rank)
                built.loop.run(_join(built.mesh, ctx.timeout_s))
        except BaseException:
            _close(built)
            raise
        self._built, self._timeout_s = built, ctx.timeout_s

    # ------------------------------------------------------------ inspect

    @property
    def group(self) -> GroupConfig:
        return self._require().group

    @property
    def rank(self) -> int:
        return self._require().rank

    @property
    def stage(self) -> StageSpec:
        return self._require().stage

    @property
    def run_id(self) -> str:
        return self._require().run

    def get_inputs(self) -> list[Tensor]:
        """The model's inputs, empty (the same for every rank of the group)."""
        return [Tensor.from_spec(spec) for spec in self._require().group.inputs]

    # ------------------------------------------------------------ predict

    def predict(self, inputs: Sequence[Tensor]) -> list[Tensor]:
        """Run this rank's stage on ``inputs`` (stage 0) or the previous stage's output."""
        built = self._require()
        env = _feeds(built, inputs) if built.stage.index == 0 else {}
        job = f"{built.run}:{built.predicts}"
        built.predicts += 1
        deadline = time.time() + self._timeout_s
        outputs = built.loop.run(_predict(built, job, env, deadline))
        return [Tensor.from_numpy(name, outputs[name]) for name in built.stage.outputs]

    # ------------------------------------------------------------ teardown

    def close(self) -> None:
        """Leave the run and free the sessions (idempotent)."""
        built, self._built = self._built, None
        if built is not None:
            _close(built)

    def __enter__(self) -> Model:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _require(self) -> _Built:
        if self._built is None:
            raise LiteError("the model is not built: call build_from_file first")
        return self._built


def _rank(location: SliceLocation, ctx: Context) -> int:
    """The rank from the context or the rank folder; they must agree when both say one."""
    if location.rank is not None and ctx.rank_id is not None and location.rank != ctx.rank_id:
        raise LiteError(
            f"the model path is rank {location.rank}'s folder but the context says rank "
            f"{ctx.rank_id}"
        )
    rank = ctx.rank_id if ctx.rank_id is not None else location.rank
    if rank is None:
        raise LiteError("no rank given: set context.rank_id or pass a rank_<r> folder")
    return rank


def _compile_cache(
    location: SliceLocation, group: GroupConfig, rank: int, ctx: Context
) -> CompileCache:
    config = SessionConfig(
        intra_op_threads=ctx.threads or 1, inter_op_threads=1, mode=ctx.cache_mode or "standard"
    )
    folder: Path | None = None
    if ctx.cache_enabled is not False:
        folder = (
            Path(ctx.cache_dir)
            if ctx.cache_dir is not None
            else default_cache_dir(group.servable, group.version, rank)
        )
    if not 0 <= rank < group.rank_size:
        raise LiteError(f"rank {rank} is outside the group (rank_size {group.rank_size})")
    return CompileCache(folder, rank, config)


def _feeds(built: _Built, inputs: Sequence[Tensor]) -> Env:
    """The stage-0 environment from the given tensors, checked against the group's inputs."""
    given = {t.name: t for t in inputs}
    env: Env = {}
    for spec in built.group.inputs:
        tensor = given.get(spec.name)
        if tensor is None:
            raise LiteError(f"input {spec.name} is missing (use model.get_inputs())")
        env[spec.name] = tensor.get_data_to_numpy()
    unknown = sorted(set(given) - set(env))
    if unknown:
        raise LiteError(f"unknown input(s) {', '.join(unknown)}")
    return env


async def _join(mesh: RunMesh, timeout_s: float) -> None:
    await mesh.open()
    await mesh.rendezvous(timeout_s)


async def _predict(built: _Built, job: str, env: Env, deadline: float) -> Env:
    mesh = built.mesh
    if mesh is None:
        return await run_stage(built.stage, built.runners, env, _SoloCollective())
    try:
        mesh.raise_if_failed(job)
        if built.stage.index > 0:
            env = await mesh.stage_input(job, deadline)
        collective: Collective = (
            mesh.hub.begin(job, deadline) if len(built.stage.ranks) > 1 else _SoloCollective()
        )
        outputs = await run_stage(built.stage, built.runners, env, collective)
        if _hands_on(built):
            await mesh.send_stage_output(job, outputs, deadline)
        return outputs
    except JobCancelledError as exc:
        raise PeerFailedError(f"rank {built.rank}: {exc}") from exc
    except PeerFailedError:
        raise  # every rank heard that failure already
    except Exception as exc:
        await mesh.announce_failure(job, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        mesh.hub.finish(job)


def _hands_on(built: _Built) -> bool:
    """True for the leader of a stage that has a next stage."""
    stage = built.stage.index
    return stage + 1 < built.group.stage_size and built.group.leader_of(stage) == built.rank


def _close(built: _Built) -> None:
    try:
        if built.mesh is not None:
            built.loop.run(built.mesh.close())
    except Exception as exc:  # leaving a broken connection: nothing left to tell the peers
        _logger.warning("closing the run's broker connection failed: %s", exc)
    finally:
        built.loop.close()
