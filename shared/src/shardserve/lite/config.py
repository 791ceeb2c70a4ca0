"""The run's ini config file (MindSpore Lite's ``config_file.ini``), parsed and checked.

Sections and keys (all optional; unknown ones are refused so a typo never goes unnoticed)::

    [cache]
    enabled = true          ; false: no compile cache at all
    dir = /var/cache/mm     ; one folder for every rank (entries are keyed by rank);
                            ; default: the agent's per-rank folder
                            ; $XDG_CACHE_HOME/shardserve/<servable>/<version>/rank_<r>
    mode = standard         ; standard | mem_opt (see shardserve.runtime.compile_cache)

    [session]
    intra_op_threads = 1    ; onnxruntime threads per segment (part of the cache key)

Relative ``dir`` values are taken relative to the ini file's folder.
"""

from __future__ import annotations

import configparser
from dataclasses import dataclass
from pathlib import Path

from shardserve.lite.errors import ConfigFileError
from shardserve.process.integers import parse_positive_int
from shardserve.runtime.compile_cache import CACHE_MODES, CacheMode

KNOWN_KEYS: dict[str, frozenset[str]] = {
    "cache": frozenset({"enabled", "dir", "mode"}),
    "session": frozenset({"intra_op_threads"}),
}


@dataclass(frozen=True)
class RunConfig:
    """What a config file says; ``None`` means "not set there"."""

    cache_enabled: bool | None = None
    cache_dir: Path | None = None
    cache_mode: CacheMode | None = None
    intra_op_threads: int | None = None


def load_config(path: Path) -> RunConfig:
    """Read and check one ini file."""
    parser = configparser.ConfigParser(inline_comment_prefixes=(";", "#"))
    try:
        with path.open() as fh:
            parser.read_file(fh)
    except OSError as exc:
        raise ConfigFileError(f"cannot read config file {path}: {exc}") from exc
    except configparser.Error as exc:
        raise ConfigFileError(f"config file {path} is not a valid ini file: {exc}") from exc
    _refuse_unknown(parser, path)
    return RunConfig(
        cache_enabled=_boolean(parser, path, "cache", "enabled"),
        cache_dir=_folder(parser, path),
        cache_mode=_mode(parser, path),
        intra_op_threads=_positive(parser, path, "session", "intra_op_threads"),
    )


def _refuse_unknown(parser: configparser.ConfigParser, path: Path) -> None:
    for section in parser.sections():
        known = KNOWN_KEYS.get(section)
        if known is None:
            raise ConfigFileError(
                f"config file {path}: unknown section [{section}] "
                f"(known: {', '.join(f'[{s}]' for s in KNOWN_KEYS)})"
            )
        unknown = sorted(set(parser[section]) - known)
        if unknown:
            raise ConfigFileError(
                f"config file {path}: unknown key(s) {', '.join(unknown)} in [{section}] "
                f"(known: {', '.join(sorted(known))})"
            )


def _boolean(parser: configparser.ConfigParser, path: Path, section: str, key: str) -> bool | None:
    if not parser.has_option(section, key):
        return None
    try:
        return parser.getboolean(section, key)
    except ValueError as exc:
        raise ConfigFileError(
            f"config file {path}: [{section}] {key} must be true or false, "
            f"got {parser.get(section, key)!r}"
        ) from exc


def _positive(parser: configparser.ConfigParser, path: Path, section: str, key: str) -> int | None:
    if not parser.has_option(section, key):
        return None
    text = parser.get(section, key)
    value = parse_positive_int(text)
    if value is None:
        raise ConfigFileError(
            f"config file {path}: [{section}] {key} must be an integer >= 1 in ASCII digits, "
            f"got {text!r}"
        )
    return value


def _folder(parser: configparser.ConfigParser, path: Path) -> Path | None:
    text = parser.get("cache", "dir", fallback="").strip()
    if not text:
        return None
    folder = Path(text).expanduser()
    return folder if folder.is_absolute() else path.parent / folder


def _mode(parser: configparser.ConfigParser, path: Path) -> CacheMode | None:
    if not parser.has_option("cache", "mode"):
        return None
    text = parser.get("cache", "mode").strip()
    if text not in CACHE_MODES:
        raise ConfigFileError(
            f"config file {path}: [cache] mode must be one of {', '.join(CACHE_MODES)}, "
            f"got {text!r}"
        )
    return text
