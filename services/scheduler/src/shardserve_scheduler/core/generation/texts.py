"""The TextModel of each generation version, loaded from its ``tokenizer/`` folder once."""

from __future__ import annotations

from pathlib import Path

from shardserve.repo.repository import GroupConfig
from shardserve.text.tokenizer import TextModel

TOKENIZER_FOLDER = "tokenizer"


class TextModels:
    """Loads on first use and keeps them; a broken folder raises RepositoryError each time."""

    def __init__(self, repository: Path) -> None:
        self._repository = repository
        self._loaded: dict[tuple[str, int], TextModel] = {}

    def __call__(self, group: GroupConfig) -> TextModel:
        key = (group.servable, group.version)
        text = self._loaded.get(key)
        if text is None:
            folder = self._repository / group.servable / str(group.version) / TOKENIZER_FOLDER
            vocab = group.origin.get("vocab")
            text = TextModel.load(folder, group.servable, int(vocab) if vocab else None)
            self._loaded[key] = text
        return text

    def forget(self, servable: str, version: int) -> None:
        self._loaded.pop((servable, version), None)
