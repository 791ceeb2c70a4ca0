"""The shardserve Python client (MindSpore Serving shaped, KServe v2 binary on the wire).

``Client`` blocks (its own loop in a background thread); ``AsyncClient`` is for asyncio
code. Both offer ``infer`` (tensors) and ``generate`` (text, whole or streamed as deltas),
and raise the ``shardserve.errors.InferenceError`` tree, plus ``ClientError`` (an HTTP
status no ErrorCode describes) and ``TransportError`` (the gateway is unreachable).
"""

from shardserve.client.aio import AsyncClient
from shardserve.client.errors import ClientError, TransportError
from shardserve.client.sync import Client, InferFuture

__all__ = ["AsyncClient", "Client", "ClientError", "InferFuture", "TransportError"]
