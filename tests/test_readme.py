"""The README's commands work as written, from a fresh clone, on this CPU.

Every fenced ``bash`` block in README.md carries a marker on the line before it:

- ``<!-- ci: run -->``: the block works on a CPU; :func:`test_readme_blocks_run_in_a_fresh_clone` runs
  each (with ``bash -e``) in a ``git clone`` of this repository where the first block's install ran (one
  clone per test worker, so the blocks run side by side);
- ``<!-- ci: .ci/run -->``: the block is what ``.ci/run`` itself runs (the test suite: running it from
  here would run this test again);
- ``<!-- ci: skip REASON -->``: it needs what this machine lacks (a GPU, a cluster), and says so.

Speed: by default the clone's ``.venv`` is made before the blocks run and reads this environment's
packages through a ``.pth`` file, so the README's ``python3 -m venv .venv`` and ``pip install`` lines
find torch, DeepSpeed and the rest installed and only install autofit itself from the clone (pip still
builds it in an isolated environment: setuptools comes from the package index).
``AUTOFIT_README_FRESH_VENV=1`` skips that and installs everything from the index, as a new user would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = re.compile(r"<!--\s*ci:\s*(run|\.ci/run|skip\s+\S.*?)\s*-->")
FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def readme_blocks(text: str) -> list[tuple[str | None, str]]:
    """``(marker, code)`` of every fenced bash block; the marker is ``run``, ``.ci/run``, ``skip ...`` or None."""
    blocks = []
    for fence in FENCE.finditer(text):
        before = text[: fence.start()].rstrip().splitlines()
        found = MARKER.search(before[-1]) if before else None
        blocks.append((found.group(1) if found else None, fence.group(1)))
    return blocks


def test_every_bash_block_says_whether_it_runs_here() -> None:
    blocks = readme_blocks(README.read_text())
    assert blocks, "the README has no bash block"
    unmarked = [code.splitlines()[0] for marker, code in blocks if marker is None]
    assert not unmarked, f"bash blocks without a <!-- ci: ... --> marker: {unmarked}"
    assert any(marker == "run" for marker, _ in blocks)


def test_the_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    for marker, code in readme_blocks(README.read_text()):
        if marker == ".ci/run":
            words = code.strip().splitlines()[-1].split("&&")[-1].split()
            assignments = [w for w in words if re.fullmatch(r"[A-Z_]+=\S*", w)]
            command = " ".join(words[len(assignments):])
            for needed in [*assignments, command]:  # the README's `VAR=x cmd` is `export VAR=x` then `cmd` there
                assert needed in ci, f"README says CI runs {needed!r}; .ci/run does not"


def _reuse_this_environment(clone: Path) -> None:
    """Make the clone's .venv and let it read this environment's packages (a plain path in a .pth file: the
    packages, not this environment's own editable autofit), with the ``ninja`` pip installs beside them: torch builds
    DeepSpeed's ops with the ``ninja`` on PATH, and a system ninja of another version (another ``.ninja_log``
    format) would rebuild every op the rest of the suite built, and the suite then rebuild them again."""
    subprocess.run([sys.executable, "-m", "venv", str(clone / ".venv")], check=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = clone / ".venv" / "lib" / version / "site-packages"
    (site / "_autofit_readme_reuse.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    ninja = Path(sys.executable).parent / "ninja"
    if ninja.exists():
        (clone / ".venv" / "bin" / "ninja").symlink_to(ninja)


def install_and_run(code: str) -> tuple[str, str]:
    """A ``run`` block split where it starts using autofit: ``(the install commands, the rest)``.

    The first block installs and runs in one line (``python3 -m venv ... && pip install ... && autofit run ...``);
    the others start by activating what it installed (``. .venv/bin/activate``) and install nothing.
    """
    lines = [line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    first = lines[0]
    if "pip install" not in first:
        return "", code
    steps = first.split(" && ")
    cut = max(i for i, step in enumerate(steps) if "pip install" in step) + 1
    return " && ".join(steps[:cut]), "\n".join([". .venv/bin/activate && " + " && ".join(steps[cut:]), *lines[1:]])


RUN_BLOCKS = [code for marker, code in readme_blocks(README.read_text()) if marker == "run"]


def _clean_env() -> dict[str, str]:
    """This environment less its venv: what a shell in a fresh clone has."""
    shared_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != shared_bin)
    return env


def _bash(code: str, clone: Path) -> None:
    done = subprocess.run(["bash", "-e", "-c", code], cwd=clone, env=_clean_env(), capture_output=True, text=True,
                          timeout=3600)
    output = f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"README block failed:\n{code}\n{output}"


@pytest.fixture(scope="session")
def readme_clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``git clone`` of this repository with the README's install done in it, as its first block writes it
    (one per test worker: each block then runs where a reader who ran the install would)."""
    clone = tmp_path_factory.mktemp("readme") / "autofit"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    if os.environ.get("AUTOFIT_README_FRESH_VENV") != "1":
        _reuse_this_environment(clone)
    install, _ = install_and_run(RUN_BLOCKS[0])
    _bash(install, clone)
    return clone


def test_the_first_block_installs_then_runs() -> None:
    install, run = install_and_run(RUN_BLOCKS[0])
    assert install.split(" && ")[-1].startswith("pip install -e")
    assert run.startswith(". .venv/bin/activate && autofit ")
    for later in RUN_BLOCKS[1:]:  # the others install nothing: the shared clone is what they need
        assert install_and_run(later)[0] == ""


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RUN_BLOCKS)), ids=lambda i: f"block{i + 1}")
def test_readme_blocks_run_in_a_fresh_clone(index: int, readme_clone: Path) -> None:
    _bash(install_and_run(RUN_BLOCKS[index])[1], readme_clone)
