"""The floors of the package, read from the source with ``ast`` (docs/architecture.md, "Floors"):

- bottom (``kvloop.shared``, ``kvloop.v1``, ``kvloop`` itself) imports no service and nothing above;
- services (``kvloop.broker``, ``kvloop.engines``, ``kvloop.router``) import only the bottom floor and themselves;
- the broker's core imports only the standard library, itself and ``kvloop.shared.errors``/``.hashing``/``.vocabulary``;
- only the top floor (CLI, local cluster, demo, engine set, benchmarks) imports the engines' launcher;
- nothing imports the services by their folder names (``broker``, ``engines``, ``router``): one namespace.

The checker is a pure function of {module: imports}; the last tests feed it forbidden imports to show it fails.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("broker", "engines", "router")
TOP = ("kvloop.app",)
"""The top floor is one subpackage: the CLI, local cluster, demo, engine set, benchmarks and analyze."""
CORE_MAY_IMPORT = ("kvloop.broker.core", "kvloop.shared.errors", "kvloop.shared.hashing", "kvloop.shared.vocabulary")
LAUNCHER = "kvloop.engines.launcher"


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def floor(module: str) -> str:
    """'top', 'service:<name>' or 'bottom'."""
    if any(within(module, t) for t in TOP):
        return "top"
    for service in SERVICES:
        if within(module, f"kvloop.{service}"):
            return f"service:{service}"
    return "bottom"


def source_files() -> Iterator[tuple[str, Path]]:
    """(module name, path) of every kvloop module, each read once at its real place."""
    roots = [(ROOT / "kvloop", "kvloop"), *[(ROOT / s, f"kvloop.{s}") for s in SERVICES]]
    for folder, package in roots:
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder)
            if any(part in SERVICES for part in rel.parts[:1]) and package == "kvloop":
                continue  # kvloop/broker etc. are links to the services' folders, read there
            parts = [package, *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


def imports_of(module: str, source: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` imports (at any depth of the file), relative imports resolved."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    stdlib = sys.stdlib_module_names
    known = set(graph)
    for module, imported in sorted(graph.items()):
        here = floor(module)
        # `from pkg.module import a_name` records pkg.module.a_name too: keep the module it names.
        names = {n.rpartition(".")[0] if n not in known and n.rpartition(".")[0] in known else n for n in imported}
        for name in sorted(names):
            top_name = name.split(".")[0]
            if top_name in SERVICES:
                problems.append(f"{module} imports {name}: use kvloop.{name}")
                continue
            if top_name != "kvloop":
                if within(module, "kvloop.broker.core") and top_name not in stdlib and top_name != "__future__":
                    problems.append(f"{module} (the broker's pure core) imports {name}")
                continue
            there = floor(name)
            if within(module, "kvloop.broker.core") and not any(within(name, ok) for ok in CORE_MAY_IMPORT):
                problems.append(f"{module} (the broker's pure core) imports {name}")
            if within(name, LAUNCHER) and here != "top" and not within(module, LAUNCHER):
                problems.append(f"{module} imports the engines' launcher (only the top floor may)")
            if here == "bottom" and there != "bottom":
                problems.append(f"{module} (bottom floor) imports {name} ({there})")
            elif here.startswith("service:") and there != "bottom" and there != here:
                problems.append(f"{module} ({here}) imports {name} ({there})")
    return problems


def real_graph() -> dict[str, set[str]]:
    return {module: imports_of(module, path.read_text(), path.name == "__init__.py")
            for module, path in source_files()}


def test_the_services_are_linked_into_the_kvloop_package() -> None:
    for service in SERVICES:
        link = ROOT / "kvloop" / service
        assert link.is_symlink() and link.resolve() == (ROOT / service).resolve(), link


def test_the_tree_keeps_its_floors() -> None:
    graph = real_graph()
    assert {"kvloop.broker.core.state", "kvloop.engines.connector.scheduler", "kvloop.router.turn",
            "kvloop.shared.protocol", "kvloop.app.cli", "kvloop.app.benchmarks.multiturn"} <= set(graph)
    assert violations(graph) == []


def test_a_service_importing_another_service_fails() -> None:
    graph = real_graph()
    graph["kvloop.router.turn"] = graph["kvloop.router.turn"] | {"kvloop.engines.config"}
    assert violations(graph) == ["kvloop.router.turn (service:router) imports kvloop.engines.config "
                                 "(service:engines)"]


def test_the_bottom_floor_importing_a_service_or_the_top_fails() -> None:
    source = "from kvloop.broker.core import BrokerState\n\ndef f():\n    from kvloop.app.cluster import LocalCluster\n"
    graph = {**real_graph(), "kvloop.shared.extra": imports_of("kvloop.shared.extra", source)}
    assert violations(graph) == [
        "kvloop.shared.extra (bottom floor) imports kvloop.app.cluster (top)",
        "kvloop.shared.extra (bottom floor) imports kvloop.broker.core (service:broker)"]


def test_the_core_importing_grpc_or_the_client_fails() -> None:
    graph = real_graph()
    graph["kvloop.broker.core.state"] = graph["kvloop.broker.core.state"] | {"grpc", "kvloop.shared.client"}
    assert violations(graph) == ["kvloop.broker.core.state (the broker's pure core) imports grpc",
                                 "kvloop.broker.core.state (the broker's pure core) imports kvloop.shared.client"]


def test_only_the_top_floor_imports_the_launcher_and_no_one_uses_folder_names() -> None:
    graph = real_graph()
    graph["kvloop.engines.sidecar.service"] = graph["kvloop.engines.sidecar.service"] | {LAUNCHER}
    graph["kvloop.router.server"] = graph["kvloop.router.server"] | {"broker.config"}
    assert violations(graph) == [
        "kvloop.engines.sidecar.service imports the engines' launcher (only the top floor may)",
        "kvloop.router.server imports broker.config: use kvloop.broker.config"]
