"""What a ``tokenizer/`` folder says besides tokenizer.json: special tokens, EOS ids, chat template.

The folder is what ``shardserve export hf`` copies from a Hugging Face checkpoint
(tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json, and
``chat_template.jinja`` when the checkpoint has one). The rules follow transformers:

* special tokens: tokenizer_config.json wins, special_tokens_map.json fills the gaps; a token
  is a string or an AddedToken-style dict ``{"content": ...}``;
* chat template: ``chat_template.jinja`` beside the config wins over ``chat_template`` in
  tokenizer_config.json, which is a string or a list of ``{"name", "template"}`` (the one named
  "default" is used);
* EOS ids: ``eos_token_id`` of generation_config.json (an int or a list), else the id of the
  config's ``eos_token``;
* sampling defaults: generation_config.json's (``shardserve.text.generation_defaults``).

Usage::

    folder = TokenizerFolder.read(path)
    folder.special_tokens        # {"bos_token": "<s>", "eos_token": "</s>", ...}
    folder.chat_template         # str | None
    folder.eos_token_ids(lookup) # lookup: token text -> id | None
    folder.sampling_defaults     # SamplingDefaults
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardserve.errors import RepositoryError
from shardserve.text.generation_defaults import SamplingDefaults

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "GENERATION_CONFIG_FILE",
    "SPECIAL_TOKENS_MAP_FILE",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_FILE",
    "TokenizerFolder",
]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names a chat template may use as variables.
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_ADDITIONAL = "additional_special_tokens"


@dataclass(frozen=True)
class TokenizerFolder:
    """The parsed side files of one tokenizer folder (tokenizer.json is read elsewhere)."""

    path: Path
    special_tokens: dict[str, str | list[str]]
    chat_template: str | None
    generation_eos: tuple[int, ...]
    sampling_defaults: SamplingDefaults

    @classmethod
    def read(cls, path: Path) -> TokenizerFolder:
        """Read the folder's JSON side files; missing files count as empty."""
        config = _read_json(path / TOKENIZER_CONFIG_FILE)
        token_map = _read_json(path / SPECIAL_TOKENS_MAP_FILE)
        generation = _read_json(path / GENERATION_CONFIG_FILE)
        return cls(
            path=path,
            special_tokens=_special_tokens(config, token_map),
            chat_template=_chat_template(path, config),
            generation_eos=_generation_eos(generation),
            sampling_defaults=SamplingDefaults.from_config(generation),
        )

    def eos_token_ids(self, token_id: Callable[[str], int | None]) -> tuple[int, ...]:
        """EOS ids: generation_config.json's, else the id of the ``eos_token``, else none."""
        if self.generation_eos:
            return self.generation_eos
        eos = self.special_tokens.get("eos_token")
        found = token_id(eos) if isinstance(eos, str) else None
        return () if found is None else (found,)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RepositoryError(f"{path}: not readable JSON: {error}") from error
    if not isinstance(value, dict):
        raise RepositoryError(f"{path}: expected a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as saved: a string, or an AddedToken dict with its ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(
    config: dict[str, Any], token_map: dict[str, Any]
) -> dict[str, str | list[str]]:
    tokens: dict[str, str | list[str]] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        # As transformers loads them: the config's value wins, the map only fills gaps.
        text = _token_text(config.get(name)) or _token_text(token_map.get(name))
        if text is not None:
            tokens[name] = text
    additional = config.get(_ADDITIONAL) or token_map.get(_ADDITIONAL)
    if isinstance(additional, list):
        texts = [_token_text(item) for item in additional]
        tokens[_ADDITIONAL] = [text for text in texts if text is not None]
    return tokens


def _chat_template(path: Path, config: dict[str, Any]) -> str | None:
    jinja_file = path / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {
            item.get("name"): item.get("template") for item in template if isinstance(item, dict)
        }
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


def _generation_eos(generation: dict[str, Any]) -> tuple[int, ...]:
    eos = generation.get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        return (eos,)
    if isinstance(eos, list) and all(isinstance(i, int) for i in eos):
        return tuple(eos)
    return ()
