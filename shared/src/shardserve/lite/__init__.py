"""MindSpore Lite's distributed-inference flow on shardserve slices, without a serving layer.

One process per rank, the same input to each; the ranks meet over RabbitMQ by a shared
run id and do their collectives and stage hand-offs directly (``shardserve.lite.wire``).
``shardserve run-rank`` is this API on the command line.
"""

from shardserve.lite.config import RunConfig, load_config
from shardserve.lite.context import Context
from shardserve.lite.errors import (
    ConfigFileError,
    LiteError,
    ModelPathError,
    PeerFailedError,
    RendezvousError,
)
from shardserve.lite.model import Model
from shardserve.lite.tensor import Tensor

__all__ = [
    "ConfigFileError",
    "Context",
    "LiteError",
    "Model",
    "ModelPathError",
    "PeerFailedError",
    "RendezvousError",
    "RunConfig",
    "Tensor",
    "load_config",
]
