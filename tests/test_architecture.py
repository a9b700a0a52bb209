"""The import floors of docs/architecture.md hold: every import of every shardrl module (type-checking ones and
imports inside functions included) goes to its own package or to a package on a lower floor, and no modules import
each other around a loop."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shardrl"
DOC = ROOT / "docs" / "architecture.md"


def floors_from_doc(text: str) -> dict[str, int]:
    """package -> floor, from the table rows `| <floor> | `pkg`, `pkg` | ... |` of the architecture doc."""
    floors = {}
    for line in text.splitlines():
        match = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if match:
            for package in re.findall(r"`(\w+)`", match.group(2)):
                floors[package] = int(match.group(1))
    return floors


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported shardrl module) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            # `from shardrl.pkg import module` imports that module
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names
                      if (PACKAGE.parent / Path(*f"{base}.{alias.name}".split("."))).with_suffix(".py").exists()]
    return [(line, name) for line, name in found if name == "shardrl" or name.startswith("shardrl.")]


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_package_is_on_a_floor():
    floors = floors_from_doc(DOC.read_text())
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages - set(floors) == set(), "add these packages to the floors table of docs/architecture.md"
    assert set(floors) - packages == set(), "docs/architecture.md names packages that do not exist"


def violations(floors: dict[str, int]) -> list[str]:
    out = []
    for module, path in MODULES.items():
        source = package_of(module)
        for line, target in imports_of(path):
            dest = package_of(target)
            if source is None or dest is None or dest == source:
                continue
            if floors[dest] >= floors[source]:
                where = "a floor above" if floors[dest] > floors[source] else "its own floor"
                out.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({dest} is on {where} {source})")
    return out


def test_imports_only_run_down_the_floors():
    problems = violations(floors_from_doc(DOC.read_text()))
    assert not problems, "\n".join(problems)


def test_the_check_sees_an_import_that_runs_up():
    """Swap two floors of the doc's table: the same code then has imports that run up, and the check says so."""
    floors = floors_from_doc(DOC.read_text())
    floors["job"], floors["workers"] = floors["workers"], floors["job"]
    assert any("imports shardrl.job" in v for v in violations(floors))


def module_graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        targets = set()
        for _, target in imports_of(path):
            while target and target not in MODULES:  # `from shardrl.pkg.mod import name` -> shardrl.pkg.mod
                target = target.rpartition(".")[0]
            if target and target != module and not module.startswith(target + "."):
                targets.add(target)
        graph[module] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_loops():
    cycle = find_cycle(module_graph())
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("graph, loop", [({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
                                         ({"a": {"b"}, "b": {"c"}, "c": set()}, False)])
def test_the_loop_check_finds_loops(graph, loop):
    assert (find_cycle(graph) is not None) == loop
