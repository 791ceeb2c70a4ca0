"""From a GenerateRequest to a Target: the version to run it on and its prompt ids.

The servable and version are found as for InferRequests (``lookup``: same rules, same
messages); the version must be a text-generation servable and its group ready. The prompt
is tokenized here (text), rendered with the chat template and tokenized (messages), or
checked against the vocabulary (ids). Every refusal is an InferenceError.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardserve.errors import BadInputError, RepositoryError, UnavailableError
from shardserve.repo.repository import GroupConfig
from shardserve.text.tokenizer import TextModel
from shardserve.wire.protocol import GenerateRequest
from shardserve_scheduler.core.catalog import Catalog
from shardserve_scheduler.core.lookup import check_group_ready, find_version
from shardserve_scheduler.core.registry import Registry

TextLoader = Callable[[GroupConfig], TextModel]


@dataclass(frozen=True)
class Placement:
    """The version a request runs on, before its prompt is tokenized."""

    group: GroupConfig
    text: TextModel
    max_positions: int


@dataclass(frozen=True)
class Target:
    group: GroupConfig
    text: TextModel
    prompt: tuple[int, ...]
    max_positions: int


def resolve_generation(
    catalog: Catalog, registry: Registry, texts: TextLoader, request: GenerateRequest
) -> Target:
    """Resolve and tokenize a request, or raise the InferenceError that answers it."""
    placed = place_generation(catalog, registry, texts, request)
    ids = prompt_ids(placed.text, request, placed.max_positions)
    return Target(placed.group, placed.text, ids, placed.max_positions)


def place_generation(
    catalog: Catalog, registry: Registry, texts: TextLoader, request: GenerateRequest
) -> Placement:
    """The version to run a request on (cheap: no tokenizing), or the InferenceError."""
    entry = find_version(catalog, registry, request.servable, request.version)
    name = entry.group.servable
    if not entry.generation:
        raise BadInputError(
            f"servable {name} version {entry.group.version} is not a text-generation "
            "servable; call its methods with an inference request"
        )
    check_group_ready(registry, entry)
    try:
        text = texts(entry.group)
    except RepositoryError as exc:
        raise UnavailableError(f"servable {name} has no usable tokenizer: {exc}") from exc
    return Placement(entry.group, text, _max_positions(entry.group))


def prompt_ids(text: TextModel, request: GenerateRequest, context: int) -> tuple[int, ...]:
    """The prompt's ids (tokenized, or rendered and tokenized, or checked): the heavy part,
    which the service runs in a worker thread. A text that surely has ``context`` tokens
    or more is refused before tokenizing (``TextModel.encode``)."""
    if request.prompt_ids is not None:
        text.check_ids(request.prompt_ids)
        return tuple(request.prompt_ids)
    if request.messages is not None:
        messages = [message.model_dump() for message in request.messages]
        ids = text.encode_chat(messages, context=context)
    else:
        ids = text.encode(request.prompt or "", context=context)
    if not ids:
        raise BadInputError("the prompt is empty: it gives no tokens")
    return tuple(ids)


def _max_positions(group: GroupConfig) -> int:
    value = group.origin.get("max_positions")
    if not isinstance(value, int) or value < 1:
        raise UnavailableError(
            f"{group.servable} v{group.version}: group.json origin has no max_positions"
        )
    return value
