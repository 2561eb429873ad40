"""The benchmarks' layout (benchmarks/README.md): one package, run as modules from the repository root, so that no
script edits ``sys.path``; no script imports a sibling by its bare name; and no two benchmark modules import each
other, directly or round a longer circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.import_graph import import_cycles

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
#: what edits the import path: ``sys.path.insert(...)``, ``.append``, ``.extend``, ``sys.path[:0] = ...``
PATH_EDIT = re.compile(r"sys\.path\.(insert|append|extend)\(|sys\.path\[[^\]]*\]\s*=|sys\.path\s*\+=")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(BENCHMARKS.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _targets(name: str, path: Path) -> list[str]:
    """The modules ``name`` imports, absolute (a relative import resolved against its package); anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package(name, path).split(".")
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return found


def _resolve(target: str) -> str | None:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        edges = {_resolve(t) for t in _targets(name, path) if t.split(".")[0] == "benchmarks"}
        graph[name] = {e for e in edges if e and e != name and not name.startswith(f"{e}.")}  # a package's __init__
    return graph


def test_the_cycle_finder_finds_a_circle_of_two_and_of_three() -> None:
    assert import_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_benchmarks_are_one_package_with_no_import_circle() -> None:
    assert len(MODULES) > 30 and "benchmarks.gpu.gpu_check" in MODULES and "benchmarks.common" in MODULES
    graph = _graph()
    assert "benchmarks.gpu.gpu_check_profiles" in graph["benchmarks.gpu.gpu_check_steps"]  # the graph sees imports
    assert import_cycles(graph) == []


def test_no_benchmark_edits_sys_path() -> None:
    edits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in sorted(BENCHMARKS.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if PATH_EDIT.search(line)]
    assert edits == []


def test_no_benchmark_imports_a_sibling_by_its_bare_name() -> None:
    """``import gpu_check_steps`` works only with the script's folder on ``sys.path``: ``benchmarks.gpu.…`` instead
    (the models under benchmarks/models/ are entries loaded by path, not imported, and are left out)."""
    stems = {path.stem for path in BENCHMARKS.rglob("*.py") if path.name != "__init__.py"}
    bare = [f"{name}: {target}" for name, path in MODULES.items()
            for target in _targets(name, path) if target.split(".")[0] in stems]
    assert bare == []
