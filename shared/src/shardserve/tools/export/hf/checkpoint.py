"""Tensors of a Hugging Face safetensors checkpoint, read one slice at a time.

``Checkpoint`` opens ``model.safetensors`` or the shards that ``model.safetensors.index.json``
names, checks every file's header up front (a truncated file, a shard the index names but
the folder lacks, are refused before anything is written), then reads a tensor -- or only
the rows or columns a rank needs, through ``get_slice`` -- as fp32. Each read opens and
closes its file, so no mapping keeps the checkpoint's pages resident between reads: the
exporter's peak memory is one rank's slice plus one tensor, not the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open

from shardserve.errors import ExportError
from shardserve.tools.export.hf.config import read_json

__all__ = ["Checkpoint", "TensorInfo"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FLOATS = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str


class Checkpoint:
    """Every tensor's file, shape and dtype; fp32 reads of whole tensors or slices."""

    def __init__(self, folder: Path, progress: Callable[[str], None] | None = None) -> None:
        self.folder = folder
        self._progress = progress
        self._tensors = _headers(_files(folder))
        self._widened: set[str] = set()

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        found = self._tensors.get(name)
        if found is None:
            raise ExportError(f"checkpoint {self.folder} has no tensor {name!r}")
        return found

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        info = self.info(name)
        if info.shape != expected:
            raise ExportError(
                f"tensor {name!r} in {info.file.name} has shape {list(info.shape)}, "
                f"config.json implies {list(expected)}"
            )
        if info.dtype not in _FLOATS:
            raise ExportError(f"tensor {name!r} is {info.dtype}, expected F32, F16 or BF16")

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> np.ndarray:
        """``name[rows, cols]`` as C-contiguous fp32 (``cols`` only for 2-D tensors)."""
        info = self.info(name)
        index = (rows or slice(None),) if cols is None else (rows or slice(None), cols)
        try:
            with safe_open(str(info.file), framework="np") as handle:
                part = handle.get_slice(name)[index]
        except Exception as exc:  # safetensors raises its own SafetensorError, and OSError
            raise ExportError(f"cannot read tensor {name!r} from {info.file}: {exc}") from exc
        return self._to_fp32(np.asarray(part), info.dtype)

    def _to_fp32(self, array: np.ndarray, dtype: str) -> np.ndarray:
        if dtype == "BF16":
            self._note(dtype)
            # numpy has no bfloat16: its bits are the top half of the fp32 with the same value.
            bits = np.ascontiguousarray(array).view(np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32)
        if dtype == "F16":
            self._note(dtype)
        return np.ascontiguousarray(array, dtype=np.float32)

    def _note(self, dtype: str) -> None:
        if dtype not in self._widened and self._progress is not None:
            self._progress(f"converted {dtype.lower()} -> fp32")
        self._widened.add(dtype)


def _files(folder: Path) -> list[Path]:
    """The safetensors files of the checkpoint: the single file, or every shard indexed."""
    if not folder.is_dir():
        raise ExportError(f"checkpoint folder {folder} does not exist")
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ExportError(f"{index} has no weight_map")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ExportError(f"{index} names shard(s) missing from {folder}: {missing}")
        return [folder / s for s in shards]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise ExportError(f"checkpoint {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def _headers(files: list[Path]) -> dict[str, TensorInfo]:
    """Read every file's header (safetensors refuses a truncated file here)."""
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="np") as handle:
                for name in handle.keys():
                    view = handle.get_slice(name)
                    tensors[name] = TensorInfo(path, tuple(view.get_shape()), view.get_dtype())
        except Exception as exc:  # SafetensorError: bad or truncated header/data
            raise ExportError(f"safetensors file {path} is damaged or truncated: {exc}") from exc
    return tensors
