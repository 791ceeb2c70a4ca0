"""``shardserve export hf``: a Hugging Face decoder checkpoint as per-rank slices.

The whole checkpoint is checked first (config, architecture, layout, every tensor's
presence and shape, every file's header), then ranks are built and written one at a time
into a scratch folder that is renamed into place at the end: a bad checkpoint leaves no
folder behind. The version folder also gets ``tokenizer/`` (tokenizer.json and friends,
generation_config.json), their sha256 listed in group.json's ``origin``.
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from shardserve.errors import ExportError, RepositoryError
from shardserve.repo.repository import (
    SERVABLE_CONFIG_FILE,
    GroupConfig,
    ProgramOp,
    RankSpec,
    rank_checksum,
    sha256_file,
    write_group,
)
from shardserve.text.token_bound import ORIGIN_KEY, most_bytes_per_token
from shardserve.text.tokenizer import TextModel
from shardserve.tools.common import (
    ExportPlan,
    Progress,
    StagePlan,
    check_servable_name,
    group_config,
    report_progress,
    servable_config_text,
    staged_version,
    write_rank_table,
    write_text_atomic,
)
from shardserve.tools.export.hf.checkpoint import Checkpoint
from shardserve.tools.export.hf.config import DecoderConfig, load_config
from shardserve.tools.export.hf.graph import build_rank, hidden_name
from shardserve.tools.export.hf.plan import RankPlan, plan_rank, stage_layers
from shardserve.tools.export.hf.weights import (
    Gpt2Weights,
    LlamaWeights,
    TensorSource,
    weight_source,
)
from shardserve.tools.quantize import QuantizedBlocks, QuantizeSpec, quantize_model
from shardserve.tools.slice_writer import EXTERNAL_DATA_THRESHOLD, save_model
from shardserve.wire.protocol import TensorSpec

__all__ = ["TOKENIZER_DIR", "TOKENIZER_FILES", "DecoderSource", "export_decoder", "export_hf"]

TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",  # transformers 5 keeps the template here, beside tokenizer_config
)
STEP_INPUTS = ("positions", "logit_rows")  # every stage reads or forwards them


@dataclass(frozen=True)
class DecoderSource:
    """What an export reads, whatever the file format: the checked config, the tensors under
    Hugging Face names, and a writer of the tokenizer folder (returns ``tokenizer/<file>`` ->
    sha256 of each file written)."""

    config: DecoderConfig
    tensors: TensorSource
    write_tokenizer: Callable[[Path], dict[str, str]]
    model: str = "hf"  # group.json origin["model"]: where the weights came from


def export_hf(
    checkpoint: Path,
    out: Path,
    *,
    rank_size: int = 1,
    stage_size: int = 1,
    name: str | None = None,
    version: int = 1,
    overwrite: bool = False,
    progress: Progress | None = None,
    quantize: QuantizeSpec | None = None,
) -> GroupConfig:
    """Write ``checkpoint`` as servable ``name`` (default: the folder's name) under ``out``;
    with ``quantize``, each rank's linear layers are quantized as its segments are written."""
    config = load_config(checkpoint)
    servable = name or checkpoint.resolve().name
    _check_tokenizer(checkpoint, servable, config.vocab)
    source = DecoderSource(
        config=config,
        tensors=Checkpoint(checkpoint, progress),
        write_tokenizer=functools.partial(_copy_tokenizer, checkpoint),
    )
    return export_decoder(
        source,
        out,
        name=servable,
        rank_size=rank_size,
        stage_size=stage_size,
        version=version,
        overwrite=overwrite,
        progress=progress,
        quantize=quantize,
    )


def export_decoder(
    source: DecoderSource,
    out: Path,
    *,
    name: str,
    rank_size: int = 1,
    stage_size: int = 1,
    version: int = 1,
    overwrite: bool = False,
    progress: Progress | None = None,
    quantize: QuantizeSpec | None = None,
) -> GroupConfig:
    """Check everything, then write ``source`` as servable ``name`` under ``out``."""
    check_servable_name(name, version)
    config = source.config
    plans = [plan_rank(config, rank_size, stage_size, r) for r in range(rank_size)]
    weights = weight_source(source.tensors, config)
    weights.check()
    report_progress(progress, f"{config.architecture}: {describe(config)}")
    with _removed_on_failure(out / name):
        with staged_version(out / name, version, overwrite=overwrite, tag=source.model) as staging:
            programs, ranks = [], []
            for plan in plans:
                program, spec = _write_rank(staging, plan, config, weights, quantize)
                programs.append(program)
                ranks.append(spec)
                report_progress(progress, _rank_line(plan.rank, rank_size, staging))
            tokenizer = source.write_tokenizer(staging / TOKENIZER_DIR)
            export = _export_plan(config, name, version, rank_size, stage_size, programs)
            export = _with_origin(export, source, tokenizer, quantize)
            export = _with_byte_bound(export, staging / TOKENIZER_DIR / "tokenizer.json")
            group = group_config(export, ranks)
            write_group(staging, group)
            write_rank_table(staging, rank_size)
        write_text_atomic(out / name / SERVABLE_CONFIG_FILE, servable_config_text(export))
    report_progress(progress, f"wrote {out / name / str(version)}")
    return group


def describe(config: DecoderConfig) -> str:
    return (
        f"{config.layers} layers, hidden {config.hidden}, {config.heads} heads "
        f"({config.kv_heads} key/value), head size {config.head_dim}, MLP {config.intermediate}, "
        f"vocab {config.vocab}, context {config.max_positions}"
    )


@contextmanager
def _removed_on_failure(servable_dir: Path) -> Iterator[None]:
    """A servable folder this export created is removed again if the export fails."""
    existed = servable_dir.exists()
    try:
        yield
    except BaseException:
        if not existed:
            shutil.rmtree(servable_dir, ignore_errors=True)
        raise


def _write_rank(
    folder: Path,
    plan: RankPlan,
    config: DecoderConfig,
    weights: Gpt2Weights | LlamaWeights,
    quantize: QuantizeSpec | None,
) -> tuple[tuple[ProgramOp, ...], RankSpec]:
    """Build one rank, writing each segment as soon as it is finished."""
    rank_folder = folder / f"rank_{plan.rank}"
    rank_folder.mkdir()
    files: dict[str, str] = {}

    def write(name: str, model: onnx.ModelProto, blocks: Mapping[str, QuantizedBlocks]) -> None:
        if quantize is not None:
            model = quantize_model(model, quantize, blocks)
        for written in save_model(model, rank_folder / name, EXTERNAL_DATA_THRESHOLD):
            files[written] = sha256_file(rank_folder / written)

    program = build_rank(config, plan, weights, sink=write).program
    files = dict(sorted(files.items()))
    spec = RankSpec(rank=plan.rank, stage=plan.stage, files=files, checksum=rank_checksum(files))
    return program, spec


def _rank_line(rank: int, rank_size: int, staging: Path) -> str:
    folder = staging / f"rank_{rank}"
    size = sum(p.stat().st_size for p in folder.iterdir())
    return f"rank {rank}/{rank_size}: wrote {len(list(folder.iterdir()))} files ({size} bytes)"


def _with_byte_bound(plan: ExportPlan, tokenizer_json: Path) -> ExportPlan:
    """The tokenizer's most bytes per token in the origin, when it bounds them: the
    scheduler tells gateways which prompts surely do not fit (``ServableStatus``)."""
    if not tokenizer_json.is_file():
        return plan
    per_token = most_bytes_per_token(json.loads(tokenizer_json.read_text(encoding="utf-8")))
    if per_token is None:
        return plan
    return replace(plan, origin={**plan.origin, ORIGIN_KEY: per_token})


def _check_tokenizer(checkpoint: Path, servable: str, vocab: int) -> None:
    """A text-generation servable is useless without its tokenizer: refuse it now, not with
    a 503 on every request once it is served."""
    try:
        TextModel.load(checkpoint, servable, vocab)
    except RepositoryError as error:
        raise ExportError(
            f"{checkpoint} has no usable tokenizer ({error}); shardserve needs tokenizer.json "
            "(the fast-tokenizer file): save it with transformers' "
            "AutoTokenizer.from_pretrained(checkpoint).save_pretrained(checkpoint)"
        ) from error


def _copy_tokenizer(checkpoint: Path, target: Path) -> dict[str, str]:
    """Copy the tokenizer files present; return ``tokenizer/<file>`` -> sha256."""
    copied: dict[str, str] = {}
    for file in TOKENIZER_FILES:
        source = checkpoint / file
        if source.is_file():
            target.mkdir(exist_ok=True)
            shutil.copyfile(source, target / file)
            copied[f"{TOKENIZER_DIR}/{file}"] = sha256_file(target / file)
    return copied


def _stage_io(
    config: DecoderConfig, stage_size: int
) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    io: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    for stage, layers in enumerate(stage_layers(config.layers, stage_size)):
        entry = "input_ids" if stage == 0 else hidden_name(layers.start)
        last = stage == stage_size - 1
        outputs = ("logits",) if last else (hidden_name(layers.stop), *STEP_INPUTS)
        io.append(((entry, *STEP_INPUTS), outputs))
    return io


def _export_plan(
    config: DecoderConfig,
    servable: str,
    version: int,
    rank_size: int,
    stage_size: int,
    programs: list[tuple[ProgramOp, ...]],
) -> ExportPlan:
    per_stage = rank_size // stage_size
    for rank, program in enumerate(programs):
        if program != programs[rank - rank % per_stage]:
            raise ExportError(f"rank {rank} has a different stage program than its stage's first")
    stages = tuple(
        StagePlan(ins, outs, programs[s * per_stage])
        for s, (ins, outs) in enumerate(_stage_io(config, stage_size))
    )
    return ExportPlan(
        servable=servable,
        version=version,
        rank_size=rank_size,
        stage_size=stage_size,
        inputs=_signature_inputs(config),
        outputs=(TensorSpec(name="logits", datatype="FP32", shape=(-1, config.vocab)),),
        stages=stages,
    )


def _signature_inputs(config: DecoderConfig) -> tuple[TensorSpec, ...]:
    """Packed rows: token ids and their positions (bounded so a bad id fails up front),
    and which rows get logits."""
    return (
        TensorSpec(
            name="input_ids", datatype="INT64", shape=(-1,), min_value=0, max_value=config.vocab - 1
        ),
        TensorSpec(
            name="positions",
            datatype="INT64",
            shape=(-1,),
            min_value=0,
            max_value=config.max_positions - 1,
        ),
        TensorSpec(name="logit_rows", datatype="INT64", shape=(-1,), min_value=0),
    )


def _with_origin(
    plan: ExportPlan,
    source: DecoderSource,
    tokenizer: dict[str, str],
    quantize: QuantizeSpec | None,
) -> ExportPlan:
    config = source.config
    origin: dict[str, str | int | float | bool] = {
        "model": source.model,
        # what the scheduler reads to serve it as a text-generation servable (GenerateRequest)
        "task": "text-generation",
        "architecture": config.architecture,
        "layers": config.layers,
        "hidden": config.hidden,
        "heads": config.heads,
        "kv_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "vocab": config.vocab,
        "max_positions": config.max_positions,
        "eos_token_ids": ",".join(str(i) for i in config.eos_token_ids),
        **tokenizer,
        **(quantize.origin() if quantize is not None else {}),
    }
    return replace(plan, origin=origin)
