"""Errors of the standalone per-rank run: each says which rank, which run and what to do."""

from __future__ import annotations

from shardserve.errors import ShardserveError


class LiteError(ShardserveError):
    """Base of every error ``shardserve.lite`` raises on purpose."""


class ConfigFileError(LiteError):
    """The ini config file is unreadable or holds an unknown or invalid option."""


class ModelPathError(LiteError):
    """The model path is neither a version folder nor a rank folder of a repository."""


class RendezvousError(LiteError):
    """Not every rank of the run showed up in time (the message names the missing ones)."""


class PeerFailedError(LiteError):
    """Another rank of the run failed; this rank cannot complete the run without it."""
