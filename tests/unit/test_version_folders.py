"""Version folders and counts read from files: only ASCII digits name a version.

Version ``n`` lives in the folder ``str(n)``; a folder ``¹`` (``str.isdigit()`` says yes,
``int()`` refuses it), ``٣`` (``int()`` reads 3) or ``01`` (``int()`` reads 1, but version 1
is loaded from ``1``) is no version: listing skips it, a path to it is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardserve.lite.config import load_config
from shardserve.lite.errors import ConfigFileError, ModelPathError
from shardserve.lite.slice import locate
from shardserve.repo.repository import GROUP_FILE, list_versions, version_of_folder

NOT_VERSIONS = ["¹", "٣", "１", "01", "0", "+1", "1 ", "v1", "9" * 19]


def _version_folder(repo: Path, name: str) -> Path:
    folder = repo / "matmul" / name
    folder.mkdir(parents=True)
    (folder / GROUP_FILE).write_text("{}")  # listing and locating look for the file only
    return folder


def test_only_ascii_version_folders_are_listed(tmp_path: Path) -> None:
    for name in ["1", "12", *NOT_VERSIONS]:
        _version_folder(tmp_path, name)
    (tmp_path / "matmul" / "3").mkdir()  # no group.json: not a version either
    assert list_versions(tmp_path, "matmul") == [1, 12]


@pytest.mark.parametrize("name", NOT_VERSIONS)
def test_a_folder_name_that_is_not_how_a_version_is_written(name: str) -> None:
    assert version_of_folder(name) is None


def test_version_folder_names() -> None:
    assert [version_of_folder(n) for n in ["1", "7", "123"]] == [1, 7, 123]


@pytest.mark.parametrize("name", ["¹", "٣", "01"])
def test_lite_refuses_a_path_to_a_folder_that_is_not_a_version(tmp_path: Path, name: str) -> None:
    folder = _version_folder(tmp_path, name)
    with pytest.raises(ModelPathError, match="not a version number"):
        locate(folder)


def test_lite_reads_a_version_folder_and_a_rank_folder(tmp_path: Path) -> None:
    folder = _version_folder(tmp_path, "2")
    (folder / "rank_1").mkdir()
    location = locate(folder / "rank_1")
    assert (location.servable, location.version, location.rank) == ("matmul", 2, 1)


@pytest.mark.parametrize("text", ["٣", "¹", "0", "-1", "+2", "2.0", "x"])
def test_lite_config_counts_are_ascii_positive_integers(tmp_path: Path, text: str) -> None:
    ini = tmp_path / "config.ini"
    ini.write_text(f"[session]\nintra_op_threads = {text}\n")
    with pytest.raises(ConfigFileError, match="must be an integer >= 1 in ASCII digits"):
        load_config(ini)


def test_lite_config_reads_a_count(tmp_path: Path) -> None:
    ini = tmp_path / "config.ini"
    ini.write_text("[session]\nintra_op_threads = 3\n")
    assert load_config(ini).intra_op_threads == 3
