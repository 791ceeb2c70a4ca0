"""``shardserve pack``: per-host bundles hold only their ranks, and say what is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardserve import cli
from shardserve.errors import RepositoryError
from shardserve.repo.pack import BUNDLE_FILE, missing_slice_message, pack_bundle, parse_ranks
from shardserve.repo.repository import load_group, verify_rank_files
from shardserve.tools.export.matmul import export_matmul


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("repo")
    export_matmul(out, rank_size=8)
    return out


@pytest.mark.parametrize(
    ("text", "ranks"),
    [("0-3", (0, 1, 2, 3)), ("5", (5,)), ("0,2,5-6", (0, 2, 5, 6)), ("3-3,1", (1, 3))],
)
def test_rank_ranges_parse(text: str, ranks: tuple[int, ...]) -> None:
    assert parse_ranks(text) == ranks


@pytest.mark.parametrize("text", ["", "a", "3-1", "-2", "1-x"])
def test_bad_rank_ranges_are_refused(text: str) -> None:
    with pytest.raises(RepositoryError):
        parse_ranks(text)


def test_bundle_holds_only_its_ranks(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "host-a"
    [packed] = pack_bundle(repo, (0, 1, 2, 3), out, servable="matmul")
    assert packed.ranks == (0, 1, 2, 3) and packed.rank_size == 8
    version = out / "matmul" / "1"
    assert sorted(p.name for p in version.iterdir() if p.is_dir()) == [
        f"rank_{r}" for r in range(4)
    ]
    assert (version / "group.json").is_file() and (version / "rank_table.json").is_file()
    assert (out / "matmul" / "servable_config.py").is_file()
    group = load_group(out, "matmul", 1)
    assert group == load_group(repo, "matmul", 1)
    for rank in range(4):
        verify_rank_files(out, group, rank)
    manifest = json.loads((out / BUNDLE_FILE).read_text())
    assert manifest["versions"] == [{"servable": "matmul", "version": 1, "ranks": [0, 1, 2, 3]}]


def test_missing_rank_names_what_the_bundle_holds(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "host-b"
    pack_bundle(repo, (4, 5, 6, 7), out)
    group = load_group(out, "matmul", 1)
    message = missing_slice_message(out, group, 2)
    assert message is not None
    assert "rank 2 of matmul v1 is not on this host" in message
    assert "holds ranks 4, 5, 6, 7" in message and "shardserve pack" in message
    assert missing_slice_message(out, group, 5) is None


def test_ranks_outside_the_group_are_refused(repo: Path, tmp_path: Path) -> None:
    with pytest.raises(RepositoryError, match=r"ranks \[8, 9\] are outside matmul v1"):
        pack_bundle(repo, (7, 8, 9), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_existing_bundle_is_kept_unless_overwrite(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "host"
    pack_bundle(repo, (0,), out)
    with pytest.raises(RepositoryError, match="--overwrite"):
        pack_bundle(repo, (1,), out)
    pack_bundle(repo, (1,), out, overwrite=True)
    assert not (out / "matmul" / "1" / "rank_0").exists()
    assert (out / "matmul" / "1" / "rank_1").is_dir()


def test_cli_pack_reports_and_fails_cleanly(
    repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    assert cli.main(["pack", str(repo), "--ranks", "0-1", "--out", str(out)]) == 0
    assert "matmul v1: ranks [0,1] of 8" in capsys.readouterr().out
    code = cli.main(["pack", str(repo), "--ranks", "9", "--out", str(tmp_path / "bad")])
    assert code == cli.EXIT_USAGE
    assert "outside matmul v1" in capsys.readouterr().err
