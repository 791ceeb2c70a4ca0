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
``standard`` (the agent's: ORT_ENABLE_ALL, planned memory patterns) and ``mem_opt``
(lower peak memory: extended optimizations without the CPU-layout rewrites, no
pre-planned patterns). Neither keeps onnxruntime's CPU memory arena: each session has its
own, holding its largest run's activations rounded up to a power of two, and a rank's
13 sessions kept 286 MB that way after 32 sequences (125 M Llama, TP 1) for no measured
speed (docs/performance.md, A rank's memory). The mode changes the saved graph,
so it is part of the key (through the optimization level, and by name).

A mem_opt entry is a folder ``<key>.mem_opt/`` (``model.onnx`` + ``model.onnx.data``, the
weights written page-aligned by onnxruntime, ``session.optimized_model_external_
initializers_*``). onnxruntime maps such a data file into memory and, with weight
prepacking off, kernels read the weights from the mapped pages: clean file pages shared
with the page cache instead of a private copy (measured, one 100 MB MatMul weight:
anonymous memory 118 -> 22 MB, load peak 245 -> 150 MB). A missing entry falls back to
the regular load (logged) and is written for the next start. The ORT-format route
(``session.use_ort_model_bytes_for_initializers`` on bytes the caller keeps alive) is
not usable from Python: the binding copies the bytes into a temporary string that is
freed before the session runs (it crashed when tried), and an ORT file loaded by path
copies its weights like a regular load.

``open(..., initializers=...)`` hands shared weights (``SessionOptions.add_initializer``)
to a session; their names are part of the key, and such sessions run without prepacking
(a packed copy per session would undo the sharing).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import onnxruntime as ort

from shardserve.repo.external import check_external_data
from shardserve.repo.repository import sha256_file
from shardserve.runtime.thread_pools import set_threads

_logger = logging.getLogger(__name__)

CacheStatus = Literal["hit", "miss", "off"]
CacheMode = Literal["standard", "mem_opt"]
CACHE_MODES: tuple[CacheMode, ...] = ("standard", "mem_opt")
OPT_LEVEL_NAME = "ORT_ENABLE_ALL"
MEM_OPT_LEVEL_NAME = "ORT_ENABLE_EXTENDED"
Initializers = Mapping[str, ort.OrtValue]
MEM_OPT_MODEL = "model.onnx"
MEM_OPT_DATA = "model.onnx.data"
# Weights smaller than this stay inline in a mem_opt graph (mapping them gains nothing).
MEM_OPT_MIN_EXTERNAL_BYTES = 4096


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """shardserve's folder of the user cache: ``$XDG_CACHE_HOME/shardserve`` (``~/.cache``
    when unset), where compile caches and the demo model live."""
    env = os.environ if environ is None else environ
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardserve"


def default_cache_dir(
    servable: str, version: int, rank: int, environ: Mapping[str, str] | None = None
) -> Path:
    """The agent's default cache folder of one rank:
    ``$XDG_CACHE_HOME/shardserve/<servable>/<version>/rank_<rank>`` (``~/.cache`` when unset).
    """
    return cache_root(environ) / servable / str(version) / f"rank_{rank}"


@dataclass(frozen=True)
class SessionConfig:
    """The session options that change the optimized graph (part of the cache key)."""

    intra_op_threads: int = 1
    inter_op_threads: int = 1
    mode: CacheMode = "standard"

    @property
    def opt_level_name(self) -> str:
        return MEM_OPT_LEVEL_NAME if self.mode == "mem_opt" else OPT_LEVEL_NAME

    def options(
        self, optimize: bool, initializers: Initializers | None = None, prepack: bool = True
    ) -> ort.SessionOptions:
        """Session options; shared ``initializers`` replace the model's own copies."""
        opts = ort.SessionOptions()
        set_threads(opts, self.intra_op_threads, self.inter_op_threads)
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        level = getattr(ort.GraphOptimizationLevel, self.opt_level_name)
        opts.graph_optimization_level = (
            level if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        )
        # Activations come from malloc, which hands freed blocks back to the next run.
        opts.enable_cpu_mem_arena = False
        if self.mode == "mem_opt":
            opts.enable_mem_pattern = False  # allocate per run, no planned buffers
        for name, value in (initializers or {}).items():
            opts.add_initializer(name, value)
        if initializers or not prepack:
            opts.add_session_config_entry("session.disable_prepacking", "1")
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
    shared: tuple[str, ...] = (),
) -> str:
    """sha256 over every ingredient that makes a saved optimized graph valid (``shared``:
    names of initializers handed in from outside). Standard-mode keys without shared
    initializers are the same as before those two ingredients existed."""
    fields: dict[str, object] = {
        "slice_sha256": slice_sha256,
        "rank": rank,
        "intra_op_threads": config.intra_op_threads,
        "inter_op_threads": config.inter_op_threads,
        "opt_level": opt_level,
        "onnxruntime": ort_version,
        "cpu": cpu,
    }
    if config.mode != "standard":
        fields["mode"] = config.mode
    if shared:
        fields["shared_initializers"] = sorted(shared)
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

    @property
    def mem_opt(self) -> bool:
        return self.config.mode == "mem_opt"

    def key_for(self, slice_sha256: str, shared: tuple[str, ...] = ()) -> str:
        return cache_key(
            slice_sha256=slice_sha256,
            rank=self.rank,
            config=self.config,
            ort_version=self._ort_version,
            cpu=self._cpu,
            opt_level=self.config.opt_level_name,
            shared=shared,
        )

    def open(
        self, path: Path, slice_sha256: str, initializers: Initializers | None = None
    ) -> tuple[ort.InferenceSession, CacheStatus]:
        """A session for one segment file, through the cache when it is on;
        ``initializers`` are shared weights that replace the segment's own copies."""
        inits = dict(initializers or {})
        if self.folder is None:
            return self._make(path, self.config.options(True, inits)), "off"
        key = self.key_for(slice_sha256, tuple(sorted(inits)))
        session = self._load(key, inits)
        if session is not None:
            return session, "hit"
        if self.mem_opt:
            _logger.info(
                "compile cache (mem_opt) has no artefact for %s; loaded it the regular way "
                "to write one, and serving from that one once written",
                path.name,
            )
            session, status = self._build_mem_opt(path, key, inits)
        else:
            session, status = self._build(path, key, inits)
        if status != "miss":
            return session, status
        # The session that wrote the entry keeps a second copy of every weight (RssAnon
        # 294 vs 166 MB after trimming, for a 128 MB slice; mem_opt 294 vs 38): serve from
        # the entry just written instead, as every later start will.
        del session
        reloaded = self._load(key, inits)
        if reloaded is None:  # (logged by _load) the regular way, once more
            return self._make(path, self.config.options(True, inits)), "off"
        return reloaded, "miss"

    def _artefact(self, key: str) -> Path:
        """An entry's model file (mem_opt: inside the entry's folder)."""
        assert self.folder is not None
        if self.mem_opt:
            return self._entry_dir(key) / MEM_OPT_MODEL
        return self.folder / f"{key}.onnx"

    def _entry_dir(self, key: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{key}.mem_opt"

    def _sidecar(self, key: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{key}.json"

    def _load(self, key: str, inits: Initializers) -> ort.InferenceSession | None:
        artefact, sidecar = self._artefact(key), self._sidecar(key)
        if not artefact.is_file() or not sidecar.is_file():
            return None
        try:
            meta = json.loads(sidecar.read_text())
            if meta.get("key") != key or not self._intact(artefact, meta):
                _logger.warning("compile cache entry %s is corrupt; rebuilding it", artefact)
                return None
            if self.mem_opt:
                check_external_data(artefact)  # its data file must be the entry's own
            # mem_opt: no prepacking, so kernels read the weights from the mapped file
            options = self.config.options(False, inits, prepack=not self.mem_opt)
            return self._make(artefact, options)
        except Exception as exc:  # any unreadable entry is rebuilt, whatever the cause
            _logger.warning("compile cache entry %s does not load (%s); rebuilding", artefact, exc)
            return None

    def _intact(self, artefact: Path, meta: dict[str, object]) -> bool:
        if meta.get("sha256") != sha256_file(artefact):
            return False
        if not self.mem_opt:
            return True
        data = artefact.parent / MEM_OPT_DATA  # absent when every weight is small
        return (sha256_file(data) if data.is_file() else None) == meta.get("data_sha256")

    def _build(
        self, path: Path, key: str, inits: Initializers
    ) -> tuple[ort.InferenceSession, CacheStatus]:
        assert self.folder is not None
        options = self.config.options(True, inits)
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
            return self._make(path, self.config.options(True, inits)), "off"
        finally:
            tmp.unlink(missing_ok=True)
        return session, "miss"

    def _build_mem_opt(
        self, path: Path, key: str, inits: Initializers
    ) -> tuple[ort.InferenceSession, CacheStatus]:
        """Serve from the segment itself (the regular load) while onnxruntime writes the
        optimized graph and its page-aligned weights into a temp folder, renamed into place."""
        assert self.folder is not None
        staging = Path(tempfile.mkdtemp(dir=self.folder, prefix=f".{key[:16]}.", suffix=".tmp"))
        options = self.config.options(True, inits)
        options.log_severity_level = 3  # as in _build
        options.optimized_model_filepath = str(staging / MEM_OPT_MODEL)
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", MEM_OPT_DATA
        )
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes",
            str(MEM_OPT_MIN_EXTERNAL_BYTES),
        )
        try:
            session = self._make(path, options)
            self._commit_entry_dir(key, staging)
        except MemoryError:
            raise
        except Exception as exc:  # saving failed (disk full, folder gone...): run uncached
            _logger.warning("compile cache %s not written (%s); running without it", staging, exc)
            return self._make(path, self.config.options(True, inits)), "off"
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return session, "miss"

    def _commit_entry_dir(self, key: str, staging: Path) -> None:
        data = staging / MEM_OPT_DATA
        meta = {
            "key": key,
            "mode": self.config.mode,
            "sha256": sha256_file(staging / MEM_OPT_MODEL),
            "data_sha256": sha256_file(data) if data.is_file() else None,
            "rank": self.rank,
            "onnxruntime": self._ort_version,
        }
        final = self._entry_dir(key)
        shutil.rmtree(final, ignore_errors=True)  # a corrupt entry being rebuilt
        os.replace(staging, final)
        _atomic_write(self._sidecar(key), json.dumps(meta, indent=2, sort_keys=True) + "\n")

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
