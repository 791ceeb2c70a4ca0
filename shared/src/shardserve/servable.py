"""servable_config.py, in MindSpore Serving's shape: declare_servable, register_method, add_stage.

A servable folder holds ``servable_config.py``::

    from shardserve.servable import add_stage, declare_servable, register_method

    model = declare_servable(rank_size=8, stage_size=1, with_batch_dim=False)

    @register_method(output_names=["y"])
    def predict(x):
        y = add_stage(model, x, outputs_count=1)
        return y

``register_method`` runs the method once at load time with placeholders, recording a
static chain of stages (the distributed model, or Python functions for pre- and
post-processing).

A text-generation servable (what ``shardserve export hf`` writes) declares itself and
registers no method::

    model = declare_servable(rank_size=2, stage_size=1, generation=True)

It takes GenerateRequests (OpenAI ``/v1/completions``, Triton ``.../generate``,
``Client.generate``, the queue level), stepped token by token over the mesh. A method
would receive one step's packed rows and run them without a KV cache, so none may be
registered: ``register_method`` in such a config is a load error naming its line.

``load_servable_config`` executes the file in isolation and returns a
``ServableDefinition``; any problem is a ``ServableConfigError`` naming file, line and
problem, and touches no other servable.
"""

from __future__ import annotations

import inspect
import runpy
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardserve.errors import ServableConfigError

# group.json ``origin["task"]`` of a text-generation servable; its servable_config.py
# declares ``generation=True`` (both written by ``shardserve export hf``)
GENERATION_TASK = "text-generation"


@dataclass(frozen=True)
class DistributedModel:
    """The servable's distributed model, as declared by ``declare_servable``."""

    rank_size: int
    stage_size: int
    with_batch_dim: bool = True
    without_batch_dim_inputs: tuple[int, ...] = ()
    enable_pipeline_infer: bool = True
    generation: bool = False


@dataclass(frozen=True)
class Placeholder:
    """A value inside a method: a method input (stage 0) or output k of stage n (from 1)."""

    stage: int
    index: int
    name: str


@dataclass(frozen=True)
class Stage:
    """One step of a method: the distributed model or a Python function."""

    index: int
    target: DistributedModel | Callable[..., Any]
    inputs: tuple[Placeholder, ...]
    outputs_count: int
    batch_size: int | None = None
    tag: str = ""

    @property
    def is_model(self) -> bool:
        return isinstance(self.target, DistributedModel)


@dataclass(frozen=True)
class MethodDefinition:
    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    stages: tuple[Stage, ...]
    outputs: tuple[Placeholder, ...]


@dataclass
class ServableDefinition:
    path: str
    model: DistributedModel | None = None
    methods: dict[str, MethodDefinition] = field(default_factory=dict)

    @property
    def generation(self) -> bool:
        """Declared ``generation=True``: it serves GenerateRequests, not methods."""
        return self.model is not None and self.model.generation


@dataclass
class _Recording:
    stages: list[Stage] = field(default_factory=list)


_current: ServableDefinition | None = None
_recording: _Recording | None = None


def declare_servable(
    rank_size: int,
    stage_size: int,
    with_batch_dim: bool = True,
    without_batch_dim_inputs: int | tuple[int, ...] | list[int] | None = None,
    enable_pipeline_infer: bool = True,
    generation: bool = False,
) -> DistributedModel:
    """Declare the servable's distributed model (exactly once per servable_config.py);
    ``generation=True`` makes it a text-generation servable (no methods)."""
    definition = _require_loading("declare_servable")
    if definition.model is not None:
        raise ValueError("declare_servable was called more than once")
    for name, value in (("rank_size", rank_size), ("stage_size", stage_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if rank_size % stage_size != 0:
        raise ValueError(f"rank_size {rank_size} is not a multiple of stage_size {stage_size}")
    if not isinstance(generation, bool):
        raise ValueError(f"generation must be True or False, got {generation!r}")
    if generation and definition.methods:
        raise ValueError(_NO_METHODS.format(methods=", ".join(sorted(definition.methods))))
    no_batch = _as_index_tuple(without_batch_dim_inputs)
    definition.model = DistributedModel(
        rank_size,
        stage_size,
        bool(with_batch_dim),
        no_batch,
        bool(enable_pipeline_infer),
        generation,
    )
    return definition.model


_NO_METHODS = (
    "a text-generation servable (declare_servable(..., generation=True)) registers no method "
    "(found: {methods}): it is called with generate requests (/v1/completions, "
    "/v1/chat/completions, /v2/models/<name>/generate), see docs/generation.md"
)


def _as_index_tuple(value: int | tuple[int, ...] | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, int) else tuple(value)
    if any(not isinstance(i, int) or i < 0 for i in items):
        raise ValueError(f"without_batch_dim_inputs must be ints >= 0, got {value!r}")
    return items


def register_method(
    output_names: str | list[str] | tuple[str, ...],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as a method; it runs once now, with placeholders."""
    names = (output_names,) if isinstance(output_names, str) else tuple(output_names)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        definition = _require_loading("register_method")
        if definition.generation:
            raise ValueError(_NO_METHODS.format(methods=fn.__name__))
        definition.methods[fn.__name__] = _record_method(fn, names)
        return fn

    return decorate


def _record_method(fn: Callable[..., Any], output_names: tuple[str, ...]) -> MethodDefinition:
    global _recording
    params = inspect.signature(fn).parameters.values()
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        raise ValueError(f"method {fn.__name__!r} may only take plain positional parameters")
    input_names = tuple(p.name for p in params)
    args = [Placeholder(0, i, n) for i, n in enumerate(input_names)]
    _recording = _Recording()
    try:
        returned = fn(*args)
    finally:
        recording, _recording = _recording, None
    outputs = returned if isinstance(returned, tuple) else (returned,)
    if len(outputs) != len(output_names):
        raise ValueError(
            f"Method return output size {len(outputs)} not match registered {len(output_names)}"
        )
    if not all(isinstance(o, Placeholder) for o in outputs):
        raise ValueError(f"method {fn.__name__!r} must return values produced by add_stage")
    return MethodDefinition(
        fn.__name__, input_names, output_names, tuple(recording.stages), outputs
    )


def add_stage(
    stage: DistributedModel | Callable[..., Any],
    *args: Placeholder,
    outputs_count: int,
    batch_size: int | None = None,
    tag: str = "",
) -> Any:
    """Add a stage to the method being registered; returns its output placeholder(s)."""
    if _recording is None:
        raise ValueError("add_stage may only be called inside a @register_method function")
    if not isinstance(stage, DistributedModel) and not callable(stage):
        raise ValueError(f"stage must be the declared model or a Python function, got {stage!r}")
    if any(not isinstance(a, Placeholder) for a in args):
        raise ValueError("add_stage inputs must be method inputs or outputs of earlier stages")
    if not isinstance(outputs_count, int) or outputs_count < 1:
        raise ValueError(f"outputs_count must be an int >= 1, got {outputs_count!r}")
    index = len(_recording.stages) + 1
    label = tag or (
        "Model" if isinstance(stage, DistributedModel) else getattr(stage, "__name__", "stage")
    )
    _recording.stages.append(Stage(index, stage, tuple(args), outputs_count, batch_size, label))
    outs = tuple(Placeholder(index, i, f"stage{index}_out{i}") for i in range(outputs_count))
    return outs[0] if outputs_count == 1 else outs


def _require_loading(api: str) -> ServableDefinition:
    if _current is None:
        raise ValueError(f"{api} may only be called while a servable_config.py is loading")
    return _current


def load_servable_config(path: Path) -> ServableDefinition:
    """Execute a servable_config.py and return what it declared, or raise ServableConfigError."""
    global _current
    definition = ServableDefinition(path=str(path))
    _current = definition
    try:
        runpy.run_path(str(path), run_name=f"shardserve_servable_{path.parent.name}")
    except SyntaxError as exc:
        raise ServableConfigError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from exc
    except SystemExit as exc:  # a config must not end the scheduler that loads it
        line = _config_line(exc, path)
        raise ServableConfigError(f"{path}:{line}: called sys.exit({exc.code!r})") from exc
    except Exception as exc:
        raise ServableConfigError(f"{path}:{_config_line(exc, path)}: {exc}") from exc
    finally:
        _current = None
    if definition.model is None:
        raise ServableConfigError(f"{path}: declare_servable(...) was never called")
    if not definition.methods and not definition.generation:
        raise ServableConfigError(
            f"{path}: no method registered (use @register_method, or declare_servable(..., "
            "generation=True) for a text-generation servable)"
        )
    return definition


def _config_line(exc: BaseException, path: Path) -> int:
    """The deepest traceback line that lies in the config file itself."""
    line = 0
    for frame in traceback.extract_tb(exc.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            line = frame.lineno or 0
    return line
