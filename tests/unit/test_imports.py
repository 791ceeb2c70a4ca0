"""Dependency direction, read from the source: services import only ``shardserve``, never
each other; ``shardserve`` imports no service; inside ``shardserve`` a layer imports only
lower layers; nothing imports by folder name (``shared``, ``services``); nothing uses pickle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT / "shared" / "src"
SERVICES = ROOT / "services"
FORBIDDEN_EVERYWHERE = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve"}
FOLDER_NAMES = {"shared", "services"}


SOURCE_ROOTS = (SHARED, *sorted(SERVICES.glob("*/src")), ROOT)  # ROOT: benchmarks


@cache
def is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of ours (``a.b`` -> a/b.py or a/b/)."""
    relative = Path(*name.split("."))
    return any(
        (root / relative).with_suffix(".py").is_file()
        or (root / relative / "__init__.py").is_file()
        for root in SOURCE_ROOTS
    )


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, inside functions too;
    relative imports skipped. ``from a import b`` yields ``a.b`` when that is a module of
    ours (``from shardserve import cli`` imports the cli), else ``a``."""
    yield from _imports(ast.parse(path.read_text(), filename=str(path)))


def _imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            submodules = [f"{node.module}.{a.name}" for a in node.names]
            for name in submodules:
                if is_module(name):
                    yield node.lineno, name
            if not all(is_module(name) for name in submodules):
                yield node.lineno, node.module


def _modules_of(source: str) -> list[str]:
    return [module for _, module in _imports(ast.parse(source))]


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
    # One finding per import line and root (``from a import b`` also yields ``a.b``).
    for line, root in sorted({(line, top(module)) for line, module in imported_modules(path)}):
        where = f"{path.name}:{line} imports {root}"
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


# ---------------------------------------------------------------- the holes, probed


def test_importing_a_layer_from_the_package_root_is_seen() -> None:
    """``from shardserve import cli`` imports the cli layer, not the root package."""
    assert "shardserve.cli" in _modules_of("from shardserve import cli\n")
    assert layer_violations("shardserve.wire.codec", "shardserve.cli")


def test_a_sibling_imported_inside_a_function_by_its_package_is_seen() -> None:
    source = "def late():\n    from shardserve.tools import export\n"
    assert "shardserve.tools.export" in _modules_of(source)
    assert layer_violations("shardserve.tools.slicing.api", "shardserve.tools.export")


def test_the_package_root_imports_nothing_of_its_own() -> None:
    """The root carries the version only, so importing it pulls in no layer."""
    root = SHARED / "shardserve" / "__init__.py"
    assert [m for _, m in imported_modules(root) if top(m) == "shardserve"] == []


def test_rooms_inside_the_services_keep_their_rules() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {problem}"
        for path in python_files(SERVICES)
        for line, imported in imported_modules(path)
        for problem in room_violations(service_module_name(path), imported)
    ]
    assert found == []


def test_the_room_check_catches_each_kind_of_hole() -> None:
    core = "shardserve_scheduler.core.jobs"
    assert room_violations(core, "shardserve_scheduler.service")  # the shell
    assert room_violations(core, "shardserve.runtime.program")  # I/O, asyncio, ctypes
    assert room_violations(core, "aio_pika")
    assert room_violations("shardserve_gateway.codecs.kserve", "shardserve_gateway.routes.kserve")
    assert room_violations("shardserve_gateway.generation.sse", "shardserve_gateway.app")
    assert room_violations("shardserve_agent.generation.steps", "shardserve_agent.service")
    assert not room_violations(core, "shardserve_scheduler.core.generation.steps")
    assert not room_violations(core, "shardserve.repo.repository")
    assert not room_violations("shardserve_gateway.codecs.kserve", "shardserve_gateway.errors")
    assert not room_violations("shardserve_gateway.routes.openai", "shardserve_gateway.codecs")


def test_no_import_cycles_anywhere_benchmarks_included() -> None:
    graph = import_graph()
    assert len(graph) > 200, "the modules were not found; the walk itself is broken"
    assert import_cycles(graph) == []


def test_the_cycle_check_finds_a_cycle_through_a_late_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


# ---------------------------------------------------------------- rooms inside the services


@dataclass(frozen=True)
class Room:
    """A folder of a service and what it may not import. ``own``: the only modules of its
    own service it may import (None: any); ``never``: prefixes it may never import."""

    own: tuple[str, ...] | None = None
    never: tuple[str, ...] = ()


IO = ("asyncio", "aio_pika", "aiormq", "aiohttp", "socket", "subprocess", "threading")
ROOMS: dict[str, Room] = {
    # The pure core: events and the time in, actions out. Never the shell, never I/O
    # (shardserve.runtime and shardserve.amqp are the agents' and the broker's).
    "shardserve_scheduler.core": Room(
        own=("shardserve_scheduler.core",),
        never=(*IO, "onnxruntime", "shardserve.amqp", "shardserve.runtime", "shardserve.client")
        + ("shardserve.lite", "shardserve.ops", "shardserve.cli", "shardserve.tools"),
    ),
    # Body formats: below every route and handler.
    "shardserve_gateway.codecs": Room(
        own=(
            "shardserve_gateway.codecs",
            "shardserve_gateway.errors",
            "shardserve_gateway.responses",
        ),
        never=("aio_pika", "shardserve.amqp"),
    ),
    "shardserve_gateway.generation": Room(
        never=("shardserve_gateway.routes", "shardserve_gateway.app", "shardserve_gateway.answer")
    ),
    "shardserve_agent.generation": Room(
        never=("shardserve_agent.service", "shardserve_agent.worker")
        + ("shardserve_agent.registration", "shardserve_agent.__main__"),
    ),
}


def service_module_name(path: Path) -> str:
    parts = list(path.relative_to(SERVICES).with_suffix("").parts[2:])
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def room_violations(importer: str, imported: str) -> list[str]:
    """Why ``importer`` (a service module) may not import ``imported`` (empty when it may)."""
    found = []
    for name, room in ROOMS.items():
        if not _within(importer, name):
            continue
        if any(_within(imported, never) for never in room.never):
            found.append(f"{importer} imports {imported} (never in {name})")
        own_service = top(imported) == top(importer)
        if room.own is not None and own_service and not any(_within(imported, o) for o in room.own):
            found.append(f"{importer} imports {imported} ({name} imports only {room.own})")
    return found


# ---------------------------------------------------------------- cycles


def _module_files() -> dict[str, Path]:
    files = {}
    for root in SOURCE_ROOTS[:-1]:
        for path in python_files(root):
            parts = list(path.relative_to(root).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in python_files(ROOT / "benchmarks"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def import_graph() -> dict[str, set[str]]:
    """Each module of ours -> the modules of ours it imports (anywhere in the file)."""
    files = _module_files()
    return {
        module: {m for _, m in imported_modules(path) if m in files and m != module}
        for module, path in files.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = [stack.pop()]
            while component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(cycles)
