"""The house rules of docs/design.md ("Architecture", "Conventions"), checked on autofit's own source: the layers in
the folders import only downwards and never in a circle, imports sit at the module top (but the heavy optional
packages, imported where used so that ``import autofit`` stays light), no function over 60 lines, no module over
500, and no comment or docstring that narrates history (which work item measured what, and when: that lives in
docs/results and in git)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.import_graph import import_cycles

PACKAGE = Path(__file__).resolve().parents[1] / "autofit"

#: the layers from the bottom up (docs/design.md, "Architecture"): a module imports only from its own layer or below
LAYERS = ("core", "machine", "workload", "ds", "cost_model", "trace", "probe", "planning", "tuner", "script", "schedule",
          "report", "commands", "cli", "__init__", "__main__")

#: packages imported inside the functions that use them: optional (extras) and heavy to import, so that
#: ``import autofit`` and the pure cost model stay light (docs/design.md, "Conventions" 1)
LAZY_PACKAGES = frozenset({
    "torch", "deepspeed", "transformers", "accelerate", "optuna", "sqlalchemy", "pynvml", "numpy", "matplotlib",
    "psutil", "bitsandbytes", "torchao", "adam_mini", "flash_attn", "lightning", "huggingface_hub", "triton",
    "resource",  # POSIX only
})

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(tree: ast.Module, *, type_only: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of a module, with whether it is in a function: those under ``if TYPE_CHECKING`` (the
    imports of annotations alone) too where ``type_only``, else not."""
    def walk(body: list[ast.stmt], in_function: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node, in_function
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                if type_only:
                    yield from walk(node.body, in_function)
                yield from walk(node.orelse, in_function)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from walk(node.body, True)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        yield from walk([n for n in inner if isinstance(n, ast.stmt | ast.ExceptHandler)], in_function)
            if isinstance(node, ast.ExceptHandler):
                yield from walk(node.body, in_function)
    yield from walk(tree.body, False)


def _targets(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]


def _graph(*, type_only: bool = False) -> dict[str, set[str]]:
    """Which of autofit's modules each imports at run time (and for its annotations alone, where ``type_only``)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        edges = graph.setdefault(name, set())
        for node, _ in _imports(ast.parse(path.read_text()), type_only=type_only):
            for target in _targets(node):
                found = _resolve(target) if target.split(".")[0] == "autofit" else None
                if found and found != name:
                    edges.add(found)
    return graph


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1] if len(parts) > 1 else "__init__")


def test_no_import_cycle() -> None:
    assert import_cycles(_graph()) == []


def test_every_module_sits_in_a_layer_and_imports_none_above_it() -> None:
    """Neither at run time nor for an annotation (``if TYPE_CHECKING``): a type a layer names is one it may use."""
    upward = [(module, target) for module, targets in _graph(type_only=True).items() for target in targets
              if _layer(target) > _layer(module)]
    assert upward == []


def _heavy_modules() -> set[str]:
    """autofit's modules that import a heavy optional package at their top, themselves or through another."""
    top: dict[str, set[str]] = {}
    heavy = set()
    for name, path in MODULES.items():
        targets = [t for node, in_function in _imports(ast.parse(path.read_text())) if not in_function
                   for t in _targets(node)]
        if any(t.split(".")[0] in LAZY_PACKAGES for t in targets):
            heavy.add(name)
        top[name] = {found for t in targets if t.split(".")[0] == "autofit" and (found := _resolve(t))}
    grown = True
    while grown:
        grown = False
        for name, targets in top.items():
            if name not in heavy and targets & heavy:
                heavy.add(name)
                grown = True
    return heavy


def test_imports_sit_at_the_module_top_but_the_heavy_optional_packages() -> None:
    """Inside a function: a heavy optional package, or one of autofit's modules that imports one at its top, on a
    line whose comment says which."""
    heavy = _heavy_modules()
    inside = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        for node, in_function in _imports(ast.parse(path.read_text())):
            if not in_function or all(t.split(".")[0] in LAZY_PACKAGES for t in _targets(node)):
                continue
            said = "#" in lines[node.lineno - 1]
            if not (said and all(_resolve(t) in heavy for t in _targets(node))):
                inside.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {ast.unparse(node)}")
    assert inside == []


@pytest.mark.parametrize("path", list(MODULES.values()), ids=list(MODULES))
def test_small_modules_and_functions(path: Path) -> None:
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES
    long = [(node.name, node.end_lineno - (node.decorator_list[0].lineno if node.decorator_list else node.lineno) + 1)
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert [(name, n) for name, n in long if n > MAX_FUNCTION_LINES] == []


#: what narrates history rather than the code: a numbered work item ("issue 48", "stop 47") or a date. An upstream
#: project's issue is cited by its own name and number (``pytorch/ao#685``, "Liger-Kernel issue #803"), which these
#: leave alone, and so is a file named by date (``h200_2026-11-28_run2.json``: no word boundary before the year)
HISTORY = re.compile(r"\bissue \d+|\bstop \d+|\b20\d\d-\d\d-\d\d\b", re.IGNORECASE)


def _prose(source: str) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of each line of a module's comments and docstrings (any string that stands as a statement:
    a module's, class's or function's docstring, or an attribute's below it)."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for offset, line in enumerate(ast.get_source_segment(source, node).splitlines()):
                yield node.lineno + offset, line


@pytest.mark.slow
def test_no_comment_or_docstring_narrates_history() -> None:
    """Comments and docstrings say what the code is and why; which work item measured what, and when, is for
    docs/results and git."""
    found = sorted(f"{path.relative_to(PACKAGE.parent)}:{line}: {match.group(0)!r} in {text.strip()!r}"
                   for path in MODULES.values() for line, text in _prose(path.read_text())
                   if (match := HISTORY.search(text)))
    assert found == []


#: the sections of a DeepSpeed JSON that only autofit/ds/ writes or reads (docs/design.md: "Where is each DeepSpeed
#: key written?"); AutoTP's by its degree's key, ``autotp_size``: its section's name, ``tensor_parallel``, is also the
#: config key's (docs/design.md, "Config keys")
DEEPSPEED_SECTIONS = frozenset({"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu",
                                "gradient_accumulation_steps", "autotp_size", "zero_allow_untested_optimizer"})


def test_deepspeed_keys_are_written_in_ds_alone() -> None:
    """No module outside ``autofit/ds/`` spells a DeepSpeed JSON section: a config is made by ``autofit.ds.emit``."""
    outside = sorted(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.value!r}"
                     for name, path in MODULES.items() if name != "autofit.ds" and not name.startswith("autofit.ds.")
                     for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Constant) and node.value in DEEPSPEED_SECTIONS)
    assert outside == []
