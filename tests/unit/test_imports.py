"""Dependency direction, read from the source: services import only ``shardserve``, never
each other; ``shardserve`` imports no service; nothing imports by folder name (``shared``,
``services``); nothing uses pickle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT / "shared" / "src"
SERVICES = ROOT / "services"
FORBIDDEN_EVERYWHERE = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve"}
FOLDER_NAMES = {"shared", "services"}


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in a file; relative imports skipped."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def python_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def top(module: str) -> str:
    return module.split(".")[0]


def service_package(path: Path) -> str:
    """The import root a service file belongs to, e.g. ``shardserve_agent``."""
    return path.relative_to(SERVICES).parts[2]


def file_violations(path: Path, own: str) -> list[str]:
    """Rule breaks in one file that belongs to the import root ``own``."""
    found = []
    for line, module in imported_modules(path):
        root = top(module)
        where = f"{path.name}:{line} imports {module}"
        if root in FORBIDDEN_EVERYWHERE:
            found.append(f"{where} (never pickle)")
        elif root in FOLDER_NAMES:
            found.append(f"{where} (import by package name, not folder)")
        elif root.startswith("shardserve_") and root != own:
            found.append(f"{where} (crosses a service boundary)")
    return found


def violations(files: list[Path]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}: {problem}"
        for path in files
        for problem in file_violations(
            path, service_package(path) if path.is_relative_to(SERVICES) else "shardserve"
        )
    ]


def test_there_is_code_to_check() -> None:
    assert python_files(SHARED), "no shared modules found; the walk itself is broken"


def test_shared_package_imports_no_service() -> None:
    assert violations(python_files(SHARED)) == []


def test_services_import_only_shardserve_and_themselves() -> None:
    files = python_files(SERVICES)
    if not files:
        pytest.skip("no service modules written yet")
    assert violations(files) == []


def test_tests_and_scripts_do_not_pickle() -> None:
    files = python_files(ROOT / "tests")
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {m}"
        for p in files
        for line, m in imported_modules(p)
        if top(m) in FORBIDDEN_EVERYWHERE
    ]
    assert bad == []


def test_the_checker_catches_what_it_should(tmp_path: Path) -> None:
    """The rules fail on a file that breaks them (a checker that cannot fail is no check)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\n"
        "from shardserve_agent import worker\n"
        "import services.agent\n"
        "from shardserve_gateway import app\n"
        "from . import sibling\n"
    )
    problems = file_violations(bad, own="shardserve_gateway")
    assert [p.split(" (")[1] for p in problems] == [
        "never pickle)",
        "crosses a service boundary)",
        "import by package name, not folder)",
    ]
    assert len(file_violations(bad, own="shardserve")) == 4
