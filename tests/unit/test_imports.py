"""Dependency direction, read from the source: services import only ``shardserve``, never
each other; ``shardserve`` imports no service; inside ``shardserve`` a layer imports only
lower layers; nothing imports by folder name (``shared``, ``services``); nothing uses pickle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

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
    assert len(files) > 30, "the service modules were not found; the walk itself is broken"
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


# The layers of ``shardserve``, lowest first. A module may import its own package and
# packages of a LOWER layer, never a package of its own layer or a higher one.
LAYERS: dict[str, int] = {
    "errors": 0,
    "wire": 1,
    "process": 1,
    "repo": 2,
    "servable": 2,
    "amqp": 3,
    "runtime": 4,
    "client": 4,
    "text": 4,
    "tools": 5,
    "lite": 6,
    "ops": 7,
    "cli": 8,
}
# Inside ``tools`` the exporters and the slicer share tools.common / tools.slice_writer and
# never import each other.
SIBLINGS_APART = {
    ("tools", "export"): ("tools", "slicing"),
    ("tools", "slicing"): ("tools", "export"),
}


def package_of(module: str) -> tuple[str, ...]:
    """``shardserve.tools.export.mlp`` -> ("tools", "export"); top-level modules alone."""
    parts = module.split(".")[1:]
    return tuple(parts[:2]) if parts and parts[0] == "tools" else tuple(parts[:1])


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SHARED).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_violations(importer: str, imported: str) -> list[str]:
    """Why ``importer`` may not import ``imported`` (empty when it may)."""
    own, other = package_of(importer), package_of(imported)
    if not own or not other or own[0] == other[0] and own == other:
        return []
    if SIBLINGS_APART.get(own) == other:
        return [f"{importer} imports {imported} (exporters and slicer stay apart)"]
    if own[0] == other[0]:
        return []
    mine, theirs = LAYERS.get(own[0]), LAYERS.get(other[0])
    if mine is None or theirs is None:
        return [f"{importer} or {imported} is in no layer (add it to LAYERS)"]
    if theirs >= mine:
        return [f"{importer} (layer {mine}) imports {imported} (layer {theirs})"]
    return []


def test_every_package_of_shardserve_has_a_layer() -> None:
    top_level = {
        p.stem if p.is_file() else p.name
        for p in (SHARED / "shardserve").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()
    }
    assert top_level == set(LAYERS)


def test_layers_import_only_lower_layers() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {problem}"
        for path in python_files(SHARED / "shardserve")
        for line, imported in imported_modules(path)
        if top(imported) == "shardserve"
        for problem in layer_violations(module_name(path), imported)
    ]
    assert found == []


def test_the_layer_check_catches_upward_and_sideways_imports() -> None:
    assert layer_violations("shardserve.wire.codec", "shardserve.amqp.broker")
    assert layer_violations("shardserve.repo.pack", "shardserve.servable")  # same layer
    assert layer_violations("shardserve.tools.export.hf", "shardserve.tools.slicing.api")
    assert layer_violations("shardserve.ops.warmup", "shardserve.cli")
    assert not layer_violations("shardserve.cli.models", "shardserve.tools.export.mlp")
    assert not layer_violations("shardserve.tools.export.mlp", "shardserve.tools.common")
    assert not layer_violations("shardserve.runtime.program", "shardserve.errors")
