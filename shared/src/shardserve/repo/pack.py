"""Per-host bundles: a model repository holding only the slices of some ranks.

``shardserve pack REPO --ranks 0-3 [--servable NAME] [--version N] --out BUNDLE`` copies,
for each selected servable version, ``servable_config.py``, ``group.json``,
``rank_table.json`` and the ``rank_<r>`` folders of the chosen ranks (each verified
against its sha256 first), plus ``bundle.json`` saying which ranks the bundle holds.
A bundle is itself a model repository: an agent host runs
``shardserve agent --repository BUNDLE --servable NAME --rank R`` for each packed rank;
an agent started for a rank the bundle lacks stops with a message naming the ranks it
does hold (``missing_slice_message``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shardserve.errors import RepositoryError
from shardserve.repo.repository import (
    GROUP_FILE,
    RANK_TABLE_FILE,
    SERVABLE_CONFIG_FILE,
    GroupConfig,
    list_servables,
    list_versions,
    load_group,
    rank_dir,
    verify_rank_files,
    version_dir,
)

BUNDLE_FILE = "bundle.json"
BUNDLE_FORMAT = "shardserve.bundle/1"


def parse_ranks(text: str) -> tuple[int, ...]:
    """``"0-3"``, ``"0,2,5-7"`` -> sorted distinct ranks; a clear error otherwise."""
    ranks: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high if sep else low)
        except ValueError:
            raise RepositoryError(f"bad rank range {part!r} (use e.g. 0-3 or 0,2,5-7)") from None
        if first < 0 or last < first:
            raise RepositoryError(f"bad rank range {part!r}: need 0 <= first <= last")
        ranks.update(range(first, last + 1))
    if not ranks:
        raise RepositoryError("no ranks given (use e.g. --ranks 0-3)")
    return tuple(sorted(ranks))


@dataclass(frozen=True)
class PackedVersion:
    servable: str
    version: int
    ranks: tuple[int, ...]
    rank_size: int
    bytes: int


def _selected_groups(repo: Path, servable: str | None, version: int | None) -> list[GroupConfig]:
    names = [servable] if servable else list_servables(repo)
    groups: list[GroupConfig] = []
    for name in names:
        versions = list_versions(repo, name)
        if not versions:
            raise RepositoryError(f"servable {name!r} has no version in repository {repo}")
        chosen = [version] if version is not None else versions
        groups.extend(load_group(repo, name, v) for v in chosen)
    if not groups:
        raise RepositoryError(f"model repository {repo} holds no servable version")
    return groups


def _check_ranks(group: GroupConfig, ranks: tuple[int, ...]) -> None:
    outside = [r for r in ranks if r >= group.rank_size]
    if outside:
        raise RepositoryError(
            f"ranks {outside} are outside {group.servable} v{group.version} "
            f"(rank_size {group.rank_size}: ranks 0-{group.rank_size - 1})"
        )


def _copy_version(repo: Path, group: GroupConfig, ranks: tuple[int, ...], out: Path) -> int:
    """Copy one version's shared files and the chosen ranks' folders; bytes copied."""
    source = version_dir(repo, group.servable, group.version)
    target = out / group.servable / str(group.version)
    target.mkdir(parents=True)
    config = repo / group.servable / SERVABLE_CONFIG_FILE
    if config.is_file():
        shutil.copy2(config, out / group.servable / SERVABLE_CONFIG_FILE)
    for name in (GROUP_FILE, RANK_TABLE_FILE):
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    copied = 0
    for rank in ranks:
        verify_rank_files(repo, group, rank)  # never ship a damaged slice
        folder = rank_dir(repo, group.servable, group.version, rank)
        (target / folder.name).mkdir()
        for name in group.ranks[rank].files:
            shutil.copy2(folder / name, target / folder.name / name)
            copied += (folder / name).stat().st_size
    return copied


def pack_bundle(
    repo: Path,
    ranks: tuple[int, ...],
    out: Path,
    *,
    servable: str | None = None,
    version: int | None = None,
    overwrite: bool = False,
) -> list[PackedVersion]:
    """Write ``out`` as a bundle of ``ranks`` (built aside, then renamed into place)."""
    groups = _selected_groups(repo, servable, version)
    for group in groups:
        _check_ranks(group, ranks)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise RepositoryError(f"{out} exists and is not empty (pass --overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        packed = [
            PackedVersion(
                g.servable, g.version, ranks, g.rank_size, _copy_version(repo, g, ranks, staging)
            )
            for g in groups
        ]
        _write_manifest(staging, packed)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return packed


def _write_manifest(folder: Path, packed: list[PackedVersion]) -> None:
    manifest = {
        "format": BUNDLE_FORMAT,
        "versions": [
            {"servable": p.servable, "version": p.version, "ranks": list(p.ranks)} for p in packed
        ],
    }
    (folder / BUNDLE_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def bundled_ranks(repo: Path, servable: str, version: int) -> tuple[int, ...] | None:
    """The ranks a bundle holds for a servable version; None if ``repo`` is no bundle."""
    try:
        manifest = json.loads((repo / BUNDLE_FILE).read_text())
    except (OSError, ValueError):
        return None
    for entry in manifest.get("versions", ()):
        if entry.get("servable") == servable and entry.get("version") == version:
            return tuple(int(r) for r in entry.get("ranks", ()))
    return ()


def missing_slice_message(repo: Path, group: GroupConfig, rank: int) -> str | None:
    """Why this host cannot serve ``rank`` (its folder is absent), or None if it is there."""
    if rank_dir(repo, group.servable, group.version, rank).is_dir():
        return None
    where = f"{group.servable} v{group.version}"
    held = bundled_ranks(repo, group.servable, group.version)
    if held is None:
        holds = "this repository has no folder for it"
    else:
        listed = ", ".join(str(r) for r in held) or "none"
        holds = f"this host's bundle holds ranks {listed} of it"
    return (
        f"rank {rank} of {where} is not on this host ({holds}); give this host a bundle "
        f"with that rank: shardserve pack REPO --ranks {rank} --servable {group.servable} "
        f"--out BUNDLE"
    )


def describe_packed(packed: list[PackedVersion], out: Path) -> str:
    lines = [f"bundle {out}:"]
    for p in packed:
        ranks = ",".join(str(r) for r in p.ranks)
        lines.append(
            f"  {p.servable} v{p.version}: ranks [{ranks}] of {p.rank_size}, "
            f"{p.bytes / 2**20:.1f} MiB of slices"
        )
    return "\n".join(lines)
