"""The docs cite only what the repository holds, and the docs site builds.

:func:`test_every_cited_repo_path_exists` reads the code, tests, benchmarks, examples, docs and the README for
repository paths (``autofit/tuner/policy.py``, ``benchmarks/results/oracle/``, ``docs/design.md``: a path whose
first part is one of the repository's top-level entries) and for ``DESIGN.md`` (the design lives in
docs/design.md), and names every one that does not exist. A path into another project (DeepSpeed's
``deepspeed/runtime/engine.py``) starts elsewhere and is not read as ours.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: where citations are read
SCANNED = ["autofit", "tests", "benchmarks", "examples", "docs", "README.md", "mkdocs.yml", "search_spaces"]
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml"}
#: the repository's top-level entries a path may start with (``.ci`` included)
TOP = sorted({p.name for p in ROOT.iterdir() if p.name not in {".git", ".venv", "site"}} | {"docs", "benchmarks"})
#: ``first/…/name.ext`` or ``first/…/dir/``, first being a top-level entry; ``{a,b}`` alternatives allowed
PATH = re.compile(
    r"(?<![\w./<>{}-])((?:" + "|".join(map(re.escape, TOP)) + r")/[\w./{},*<>-]*[\w/}*>])"
)
#: ``DESIGN.md`` alone: the design before it moved into docs/
DESIGN = re.compile(r"(?<![\w/.-])DESIGN\.md")
#: paths cited on purpose that the repository does not hold: path -> why
NOT_IN_REPO = {
    "benchmarks/results/cuda": "benchmarks/accuracy/cuda_accuracy.py writes it on a GPU (not run on one yet)",
    "benchmarks/results/cuda/cuda_accuracy.md": "benchmarks/accuracy/cuda_accuracy.py writes it on a GPU",
    "benchmarks/results/cuda/cuda_accuracy.json": "benchmarks/accuracy/cuda_accuracy.py writes it on a GPU",
    "benchmarks/results/ds_autotune_config.json": "benchmarks/peers/compare_search.py --autotuner writes it",
    "benchmarks/results/memory_accuracy.json": "benchmarks/accuracy/memory_accuracy.py --json writes it (the docstring's example)",
    "benchmarks/models/__init__.py": "tests/test_examples.py leaves it out of the shipped models, should one be added",
}

def scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts]
    return files


def expand(path: str) -> list[str]:
    """``a/b.{json,md}`` -> ``a/b.json``, ``a/b.md``; the trailing punctuation of prose dropped."""
    path = path.rstrip(".,:;")
    braces = re.search(r"\{([^{}]*)\}", path)
    if not braces or "," not in braces.group(1):  # none, or an f-string's {name}: a placeholder (exists() passes it)
        return [path]
    return [p for alt in braces.group(1).split(",") for p in expand(path[: braces.start()] + alt + path[braces.end():])]


def exists(path: str) -> bool:
    if re.search(r"[<>{}]", path):  # a placeholder: benchmarks/results/<name>.json, an f-string's {name}
        return True
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def unresolved(line: str) -> list[str]:
    """The repository paths ``line`` cites that do not exist, and ``DESIGN.md`` where it is cited."""
    found = ["DESIGN.md (the design is docs/design.md)"] if DESIGN.search(line) else []
    for cited in PATH.findall(line):
        found += [p for p in expand(cited.split(":")[0]) if p not in NOT_IN_REPO and not exists(p)]
    return found


def test_every_cited_repo_path_exists() -> None:
    missing = [f"{file.relative_to(ROOT)}:{number}: {path}"
               for file in scanned_files() if file != Path(__file__).resolve()  # this file cites made-up paths
               for number, line in enumerate(file.read_text(errors="replace").splitlines(), 1)
               for path in unresolved(line)]
    assert not missing, "cited paths that are not in the repository:\n" + "\n".join(missing)


def test_the_scan_tells_ours_from_theirs() -> None:
    line = ("see autofit/not_here.py, docs/design.md, benchmarks/results/deepspeed_estimators.{json,md}, "
            "DESIGN.md's table, deepspeed/runtime/engine.py and examples/gpt.py:workload")
    assert unresolved(line) == ["DESIGN.md (the design is docs/design.md)", "autofit/not_here.py"]
    assert unresolved("benchmarks/results/deepspeed_estimators.{json,nope}") == ["benchmarks/results/deepspeed_estimators.nope"]


def test_the_nav_names_pages_that_exist() -> None:
    yaml = pytest.importorskip("yaml")

    class Loader(yaml.SafeLoader):
        pass

    # mkdocs.yml may hold !!python/name tags (pymdownx); only the nav is read here
    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)

    def pages(nav: object) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, list):
            return [p for item in nav for p in pages(item)]
        if isinstance(nav, dict):
            return [p for value in nav.values() for p in pages(value)]
        return []

    listed = pages(config["nav"])
    assert listed
    assert [p for p in listed if not (ROOT / "docs" / p).is_file()] == []


@pytest.mark.slow
def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    if shutil.which("mkdocs") is None and subprocess.run([sys.executable, "-c", "import mkdocs"]).returncode:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]'")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "results" / "memory" / "index.html").is_file()
    assert "Generated from" in (tmp_path / "site" / "results" / "memory" / "index.html").read_text()
