"""The model repository: servables, versions, and each version's group config.

Layout (our equivalent of MindSpore's per-device model files + group_config.pb)::

    <repo>/<servable>/servable_config.py          methods and stages
    <repo>/<servable>/<version>/group.json        GroupConfig below
    <repo>/<servable>/<version>/rank_table.json   MindSpore Serving server_list layout
    <repo>/<servable>/<version>/rank_<r>/*.onnx   rank r's segments, nothing else

``group.json`` says, per stage, the ordered program every rank of the stage runs
(ONNX segments and the collectives between them), and per rank its stage, its files and
their sha256. Agents load only their own ``rank_<r>`` folder; any path leaving it is
refused.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shardserve.errors import ChecksumError, RepositoryError, UnsafePathError
from shardserve.process.integers import parse_positive_int
from shardserve.wire.protocol import TensorSpec

GROUP_FORMAT: Final = "shardserve.group/1"
GROUP_FILE = "group.json"
RANK_TABLE_FILE = "rank_table.json"
SERVABLE_CONFIG_FILE = "servable_config.py"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RunOp(_Frozen):
    """Run one ONNX segment; its graph inputs are taken from, and outputs put into, the
    stage's environment of named tensors."""

    op: Literal["run"] = "run"
    file: str


class AllGatherOp(_Frozen):
    """Concatenate every rank's ``input`` (in rank order) along ``axis`` into ``output``."""

    op: Literal["allgather"] = "allgather"
    input: str
    output: str
    axis: int


class AllReduceOp(_Frozen):
    """Sum every rank's ``input`` (in rank order, so all ranks get identical bits)."""

    op: Literal["allreduce"] = "allreduce"
    input: str
    output: str
    reduce: Literal["sum"] = "sum"


class AttentionOp(_Frozen):
    """Causal attention of a step's packed rows over the rank's KV cache of ``layer``: reads
    ``q`` [N, Hq, D], ``k`` and ``v`` [N, Hkv, D], writes ``output`` [N, Hq*D]. It runs in the
    rank's runtime (numpy), not in ONNX: the caller of the program supplies the KV cache and
    the step's layout (which rows are which sequence at which positions)."""

    op: Literal["attention"] = "attention"
    layer: int = Field(ge=0)
    q: str
    k: str
    v: str
    output: str


ProgramOp = Annotated[RunOp | AllGatherOp | AllReduceOp | AttentionOp, Field(discriminator="op")]


class StageSpec(_Frozen):
    """One pipeline stage: its ranks and the program each of them runs."""

    index: int = Field(ge=0)
    ranks: tuple[int, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    program: tuple[ProgramOp, ...]

    @property
    def collective_count(self) -> int:
        return sum(1 for op in self.program if isinstance(op, AllGatherOp | AllReduceOp))

    @cached_property
    def final_collectives(self) -> frozenset[int]:
        """Program indices of the collectives whose result only the stage's leader needs:
        those after the stage's last segment run whose output is a stage output that no
        later collective reads. Empty unless every stage output comes from one of them, so
        a rank holds either all of its stage's outputs or none. A fact of the program, so
        it lives here: the agents' runtime and the scheduler's pure core both read it."""
        computed = (RunOp, AttentionOp)  # ops that compute locally, unlike the collectives
        program = self.program
        last_run = max((i for i, op in enumerate(program) if isinstance(op, computed)), default=-1)
        producer: dict[str, int] = {}
        for index in range(last_run + 1, len(program)):
            op = program[index]
            assert isinstance(op, AllGatherOp | AllReduceOp)
            read_later = {
                later.input
                for later in program[index + 1 :]
                if isinstance(later, AllGatherOp | AllReduceOp)
            }
            if op.output in self.outputs and op.output not in read_later:
                producer[op.output] = index
        if not self.outputs or set(self.outputs) != set(producer):
            return frozenset()
        return frozenset(producer.values())

    @property
    def outputs_at_leader(self) -> bool:
        """Whether the stage's outputs are combined at its leader alone."""
        return bool(self.final_collectives)


class RankSpec(_Frozen):
    """One rank: its stage and its files with their sha256."""

    rank: int = Field(ge=0)
    stage: int = Field(ge=0)
    files: dict[str, str]
    checksum: str


class GroupConfig(_Frozen):
    """Everything the scheduler and agents need to know about one servable version."""

    format: Literal["shardserve.group/1"] = GROUP_FORMAT
    servable: str
    version: int = Field(ge=1)
    rank_size: int = Field(ge=1)
    stage_size: int = Field(ge=1)
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    with_batch_dim: bool = False
    max_batch_size: int = Field(default=0, ge=0)
    stages: tuple[StageSpec, ...]
    ranks: tuple[RankSpec, ...]
    origin: dict[str, str | int | float | bool] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> GroupConfig:
        check_rank_stage(self.rank_size, self.stage_size)
        if len(self.stages) != self.stage_size:
            raise ValueError(f"{len(self.stages)} stages listed, stage_size is {self.stage_size}")
        if [r.rank for r in self.ranks] != list(range(self.rank_size)):
            raise ValueError(f"ranks must be listed as 0..{self.rank_size - 1} in order")
        per_stage = self.rank_size // self.stage_size
        for spec in self.ranks:
            if spec.stage != spec.rank // per_stage:
                raise ValueError(
                    f"rank {spec.rank} is in stage {spec.stage}, expected {spec.rank // per_stage}"
                )
        return self

    @property
    def ranks_per_stage(self) -> int:
        return self.rank_size // self.stage_size

    def stage_of(self, rank: int) -> StageSpec:
        return self.stages[self.ranks[rank].stage]

    def leader_of(self, stage: int) -> int:
        """The rank of a stage that ships the stage's output tensors (the others send digests)."""
        return self.stages[stage].ranks[0]


def check_rank_stage(rank_size: int, stage_size: int) -> None:
    """Refuse rank/stage combinations that cannot form a pipeline, saying why."""
    if rank_size < 1 or stage_size < 1:
        raise RepositoryError(
            f"rank_size and stage_size must be >= 1, got {rank_size}, {stage_size}"
        )
    if rank_size % stage_size != 0:
        raise RepositoryError(
            f"rank_size must be an integral multiple of stage_size, "
            f"rank_size: {rank_size}, stage_size: {stage_size}"
        )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rank_checksum(files: dict[str, str]) -> str:
    """One checksum for a rank's slice: sha256 over its sorted (name, sha256) pairs."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{files[name]}\n".encode())
    return h.hexdigest()


def confined(root: Path, relative: str) -> Path:
    """Resolve ``relative`` under ``root``; refuse absolute paths, '..' and symlink escapes."""
    if not relative or Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise UnsafePathError(f"path {relative!r} must be relative and stay inside {root}")
    base = root.resolve()
    target = (base / relative).resolve()
    if base != target and base not in target.parents:
        raise UnsafePathError(f"path {relative!r} escapes {root}")
    return target


def version_dir(repo: Path, servable: str, version: int) -> Path:
    return confined(repo, f"{servable}/{version}")


def rank_dir(repo: Path, servable: str, version: int, rank: int) -> Path:
    return version_dir(repo, servable, version) / f"rank_{rank}"


def load_group(repo: Path, servable: str, version: int) -> GroupConfig:
    """Read and validate ``<repo>/<servable>/<version>/group.json``."""
    path = version_dir(repo, servable, version) / GROUP_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise RepositoryError(f"no group config at {path}") from exc
    except json.JSONDecodeError as exc:
        raise RepositoryError(f"{path} is not valid JSON: {exc}") from exc
    try:
        group = GroupConfig.model_validate(raw)
    except ValidationError as exc:
        raise RepositoryError(f"{path} is not a valid group config: {exc}") from exc
    if group.servable != servable or group.version != version:
        raise RepositoryError(
            f"{path} describes {group.servable} v{group.version}, expected {servable} v{version}"
        )
    return group


def verify_rank_files(repo: Path, group: GroupConfig, rank: int) -> dict[str, Path]:
    """Check a rank's files exist and match their sha256; return name -> path."""
    if not 0 <= rank < group.rank_size:
        raise RepositoryError(f"rank {rank} is outside the group (rank_size {group.rank_size})")
    folder = rank_dir(repo, group.servable, group.version, rank)
    paths: dict[str, Path] = {}
    for name, expected in group.ranks[rank].files.items():
        path = confined(folder, name)
        if not path.is_file():
            raise RepositoryError(f"rank {rank} slice file {path} is missing")
        actual = sha256_file(path)
        if actual != expected:
            raise ChecksumError(
                f"rank {rank} slice file {path} has sha256 {actual[:12]}..., "
                f"group config says {expected[:12]}..."
            )
        paths[name] = path
    return paths


def list_servables(repo: Path) -> list[str]:
    """Servable folder names of a repository (folders holding at least one version)."""
    if not repo.is_dir():
        raise RepositoryError(f"model repository {repo} does not exist")
    return sorted(p.name for p in repo.iterdir() if p.is_dir() and list_versions(repo, p.name))


def list_versions(repo: Path, servable: str) -> list[int]:
    """Version numbers (folders named by a version, with a group.json), ascending."""
    folder = confined(repo, servable)
    if not folder.is_dir():
        return []
    return sorted(
        version
        for p in folder.iterdir()
        if (version := version_of_folder(p.name)) is not None
        and p.is_dir()
        and (p / GROUP_FILE).is_file()
    )


def version_of_folder(name: str) -> int | None:
    """The version a folder name stands for, or None. Version ``n`` lives in the folder
    ``str(n)`` (see ``version_dir``), so ``'01'`` is none either, nor is ``'¹'``."""
    version = parse_positive_int(name)
    return version if version is not None and str(version) == name else None


def write_group(folder: Path, group: GroupConfig) -> Path:
    """Write group.json deterministically (sorted keys, fixed indentation)."""
    path = folder / GROUP_FILE
    data = group.model_dump(mode="json")
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def rank_table(rank_size: int, host: str = "127.0.0.1") -> dict[str, object]:
    """A rank table in MindSpore Serving's server_list layout (8 devices per server)."""
    servers: list[dict[str, object]] = []
    for start in range(0, rank_size, 8):
        devices = [
            {
                "device_id": str(r - start),
                "device_ip": f"192.{r - start + 1}.0.1",
                "rank_id": str(r),
            }
            for r in range(start, min(start + 8, rank_size))
        ]
        servers.append({"server_id": host, "device": devices, "host_nic_ip": "reserve"})
    return {
        "version": "1.0",
        "server_count": str(len(servers)),
        "server_list": servers,
        "status": "completed",
    }
