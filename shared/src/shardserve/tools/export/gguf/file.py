"""A GGUF file opened with the ``gguf`` package's reader: its metadata by key and its tensors
by name (memory-mapped; nothing is read until a tensor is dequantized)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader, ReaderTensor

from shardserve.errors import ExportError

__all__ = ["GgufFile"]


class GgufFile:
    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise ExportError(f"GGUF file {path} does not exist")
        try:
            reader = GGUFReader(path)
        except Exception as exc:  # the reader raises ValueError, struct.error, OSError, ...
            raise ExportError(f"{path} is not a readable GGUF file: {exc}") from exc
        self.path = path
        self._fields = reader.fields
        self.tensors: dict[str, ReaderTensor] = {t.name: t for t in reader.tensors}

    def __contains__(self, key: object) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (str, int, float, bool, or a list of them)."""
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ExportError(f"GGUF file {self.path.name} has no metadata key {key!r}")
        return value

    def positive(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise ExportError(f"GGUF file {self.path.name} has no metadata key {key!r}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ExportError(f"GGUF metadata {key} must be a positive integer, got {value!r}")
        return value

    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end a generation: EOS, and end-of-turn where the file names one."""
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        return tuple(dict.fromkeys(int(self.get(k)) for k in keys if self.get(k) is not None))
