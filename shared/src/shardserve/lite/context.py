"""``lite.Context``: where and how one rank runs (MindSpore Lite's ``mslite.Context``).

Every field may be set by constructor argument or attribute. ``None`` means "not set":
the config file passed to ``Model.build_from_file`` fills it, then the defaults do.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from shardserve.lite.config import RunConfig
from shardserve.lite.errors import LiteError
from shardserve.process.settings import BrokerSettings
from shardserve.runtime.compile_cache import CacheMode

RUN_ID_ENV = "SHARDSERVE_RUN_ID"
DEFAULT_TIMEOUT_S = 60.0
# A standalone run gives up on an unreachable broker after this long (with the reason);
# SHARDSERVE_AMQP_CONNECT_WAIT overrides it.
LITE_CONNECT_WAIT_S = 10.0
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class Context:
    """The rank, its compile cache, and how it meets its peers."""

    rank_id: int | None = None
    cache_dir: Path | str | None = None
    cache_mode: CacheMode | None = None
    cache_enabled: bool | None = None
    threads: int | None = None
    run_id: str | None = None  # None: $SHARDSERVE_RUN_ID, else "<servable>-v<version>"
    amqp_url: str | None = None  # None: $SHARDSERVE_AMQP_URL, else the local broker
    timeout_s: float = DEFAULT_TIMEOUT_S  # rendezvous, and each predict

    def merged(self, config: RunConfig) -> Context:
        """This context with unset fields taken from the config file."""
        return replace(
            self,
            cache_dir=self.cache_dir if self.cache_dir is not None else config.cache_dir,
            cache_mode=self.cache_mode or config.cache_mode,
            cache_enabled=(
                self.cache_enabled if self.cache_enabled is not None else config.cache_enabled
            ),
            threads=self.threads or config.intra_op_threads,
        )

    def resolved_run_id(self, servable: str, version: int) -> str:
        run = self.run_id or os.environ.get(RUN_ID_ENV) or _safe(f"{servable}-v{version}")
        if not _RUN_ID.fullmatch(run):
            raise LiteError(
                f"run id {run!r} must be 1-64 characters of letters, digits, '_' or '-'"
            )
        return run

    def broker_settings(self) -> BrokerSettings:
        settings = BrokerSettings.from_env()
        if self.amqp_url:
            settings = replace(settings, urls=(self.amqp_url,))
        if not settings.connect_wait_s:  # services wait for a broker forever; a run fails
            settings = replace(settings, connect_wait_s=LITE_CONNECT_WAIT_S)
        return settings


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)[:64]
