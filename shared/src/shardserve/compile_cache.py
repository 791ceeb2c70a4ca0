"""Per-rank compile cache: onnxruntime's optimized graph, saved once and reloaded as is.

The equivalent of MindSpore Lite's ``model_cache`` (one ``model_build_cache_<rank>`` per
rank): the first start optimizes the slice with ``ORT_ENABLE_ALL`` and saves the result
(``SessionOptions.optimized_model_filepath``); later starts load the saved graph with
optimizations off. An entry is ``<key>.onnx`` + ``<key>.json`` (the key and the
artefact's sha256). The key covers everything that makes an artefact valid (slice bytes,
session options, onnxruntime version, CPU features, rank), so ranks sharing a folder or an
upgraded runtime never pick up a wrong artefact. Entries are written via a temp file and
``os.replace``; a corrupt or half-written one is detected and rebuilt. Any cache trouble
costs a warning, never the agent.

Optimized graphs at ORT_ENABLE_ALL may hold CPU-specific kernels; that is why the CPU
flags are in the key. Treat the folder like code: only the agent's user may write it.

Shared by the agent, ``shardserve warmup`` (fills the cache ahead of time) and the
standalone per-rank run (``shardserve.lite``): all three compute the same key, so a cache
built by one is hit by the others. Two modes, as in MindSpore Lite's config file:
``standard`` (the agent's: ORT_ENABLE_ALL, onnxruntime's memory arena and planned memory
patterns) and ``mem_opt`` (lower peak memory: extended optimizations without the
CPU-layout rewrites, no arena, no pre-planned patterns). The mode changes the saved graph,
so it is part of the key (through the optimization level).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import onnxruntime as ort

from shardserve.repository import sha256_file

_logger = logging.getLogger(__name__)

CacheStatus = Literal["hit", "miss", "off"]
CacheMode = Literal["standard", "mem_opt"]
CACHE_MODES: tuple[CacheMode, ...] = ("standard", "mem_opt")
OPT_LEVEL_NAME = "ORT_ENABLE_ALL"
MEM_OPT_LEVEL_NAME = "ORT_ENABLE_EXTENDED"


def default_cache_dir(
    servable: str, version: int, rank: int, environ: Mapping[str, str] | None = None
) -> Path:
    """The agent's default cache folder of one rank:
    ``$XDG_CACHE_HOME/shardserve/<servable>/<version>/rank_<rank>`` (``~/.cache`` when unset).
    """
    env = os.environ if environ is None else environ
    base = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "shardserve" / servable / str(version) / f"rank_{rank}"


@dataclass(frozen=True)
class SessionConfig:
    """The session options that change the optimized graph (part of the cache key)."""

    intra_op_threads: int = 1
    inter_op_threads: int = 1
    mode: CacheMode = "standard"

    @property
    def opt_level_name(self) -> str:
        return MEM_OPT_LEVEL_NAME if self.mode == "mem_opt" else OPT_LEVEL_NAME

    def options(self, optimize: bool) -> ort.SessionOptions:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = self.intra_op_threads
        opts.inter_op_num_threads = self.inter_op_threads
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        level = getattr(ort.GraphOptimizationLevel, self.opt_level_name)
        opts.graph_optimization_level = (
            level if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        )
        if self.mode == "mem_opt":
            # Allocate per run instead of keeping onnxruntime's arena and planned buffers.
            opts.enable_cpu_mem_arena = False
            opts.enable_mem_pattern = False
        return opts


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's feature flags (sorted), or the machine name where /proc is not there."""
    try:
        for line in cpuinfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() in ("flags", "Features"):
                return " ".join(sorted(value.split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cache_key(
    *,
    slice_sha256: str,
    rank: int,
    config: SessionConfig,
    ort_version: str,
    cpu: str,
    opt_level: str = OPT_LEVEL_NAME,
) -> str:
    """sha256 over every ingredient that makes a saved optimized graph valid."""
    fields = {
        "slice_sha256": slice_sha256,
        "rank": rank,
        "intra_op_threads": config.intra_op_threads,
        "inter_op_threads": config.inter_op_threads,
        "opt_level": opt_level,
        "onnxruntime": ort_version,
        "cpu": cpu,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


SessionMaker = Callable[[Path, ort.SessionOptions], ort.InferenceSession]


def make_session(path: Path, options: ort.SessionOptions) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class CompileCache:
    """One rank's cache folder. ``folder=None`` means the cache is off."""

    def __init__(
        self,
        folder: Path | None,
        rank: int,
        config: SessionConfig,
        *,
        cpu: str | None = None,
        ort_version: str | None = None,
        session_maker: SessionMaker = make_session,
    ) -> None:
        self.rank = rank
        self.config = config
        self._cpu = cpu if cpu is not None else cpu_features()
        self._ort_version = ort_version or ort.__version__
        self._make = session_maker
        self.folder = folder if folder is not None and _usable(folder) else None

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def key_for(self, slice_sha256: str) -> str:
        return cache_key(
            slice_sha256=slice_sha256,
            rank=self.rank,
            config=self.config,
            ort_version=self._ort_version,
            cpu=self._cpu,
            opt_level=self.config.opt_level_name,
        )

    def open(self, path: Path, slice_sha256: str) -> tuple[ort.InferenceSession, CacheStatus]:
        """A session for one segment file, through the cache when it is on."""
        if self.folder is None:
            return self._make(path, self.config.options(optimize=True)), "off"
        key = self.key_for(slice_sha256)
        session = self._load(key)
        if session is not None:
            return session, "hit"
        return self._build(path, key)

    def _artefact(self, key: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{key}.onnx"

    def _sidecar(self, key: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{key}.json"

    def _load(self, key: str) -> ort.InferenceSession | None:
        artefact, sidecar = self._artefact(key), self._sidecar(key)
        if not artefact.is_file() or not sidecar.is_file():
            return None
        try:
            meta = json.loads(sidecar.read_text())
            if meta.get("key") != key or meta.get("sha256") != sha256_file(artefact):
                _logger.warning("compile cache entry %s is corrupt; rebuilding it", artefact)
                return None
            return self._make(artefact, self.config.options(optimize=False))
        except Exception as exc:  # any unreadable entry is rebuilt, whatever the cause
            _logger.warning("compile cache entry %s does not load (%s); rebuilding", artefact, exc)
            return None

    def _build(self, path: Path, key: str) -> tuple[ort.InferenceSession, CacheStatus]:
        assert self.folder is not None
        options = self.config.options(optimize=True)
        # ORT warns that ENABLE_ALL graphs may not suit other hardware: the key holds the CPU.
        options.log_severity_level = 3
        fd, tmp_name = tempfile.mkstemp(dir=self.folder, prefix=f".{key[:16]}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(tmp_name)
        options.optimized_model_filepath = str(tmp)
        try:
            session = self._make(path, options)
            self._commit(key, tmp)
        except MemoryError:
            raise
        except Exception as exc:  # saving failed (disk full, folder gone...): run uncached
            _logger.warning("compile cache %s not written (%s); running without it", tmp, exc)
            return self._make(path, self.config.options(optimize=True)), "off"
        finally:
            tmp.unlink(missing_ok=True)
        return session, "miss"

    def _commit(self, key: str, tmp: Path) -> None:
        digest = sha256_file(tmp)
        os.replace(tmp, self._artefact(key))
        meta = {"key": key, "sha256": digest, "rank": self.rank, "onnxruntime": self._ort_version}
        _atomic_write(self._sidecar(key), json.dumps(meta, indent=2, sort_keys=True) + "\n")


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _usable(folder: Path) -> bool:
    """Create the folder if needed and prove we can write in it; warn if not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe.")
        os.close(fd)
        os.unlink(probe)
        return True
    except OSError as exc:
        _logger.warning(
            "compile cache folder %s is not writable (%s); running without cache", folder, exc
        )
        return False
