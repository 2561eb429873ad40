"""Planning from an entry's sources (autofit.trace.source_cache): a warm plan that does not load the workload gives
the cold plan's ranked estimate; a changed entry file, imported sibling, hf config.json or request misses; a
Workload object never uses it; a corrupt record is ignored."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

import autofit
from autofit.commands.estimate import estimate_target
from autofit.core.errors import AutofitError
from autofit.planning.target import Target, prepare
from autofit.trace import cache, source_cache
from autofit.trace.parallel import TRACE_WORKERS_ENV
from autofit.trace.source_cache import SourcePlannedWorkload, source_key
from autofit.workload.hf import with_hf_options

ROOT = Path(__file__).resolve().parents[2]

PARTS = """
import torch
from torch import nn

WIDTH = {width}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()
"""

ENTRY = """
import torch

from autofit import Workload
from {parts} import WIDTH, Small


def workload():
    return Workload(model=Small, batch=lambda n: torch.randn(n, {tokens}, WIDTH), name="small", tokens_per_sample={tokens})
"""


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache on, in a directory of this test's own."""
    monkeypatch.delenv(cache.NO_CACHE_ENV, raising=False)
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "traces"


def write_entry(folder: Path, width: int = 32, tokens: int = 16) -> str:
    """An entry file importing a sibling module (with unique module names: each test's modules are fresh)."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = f"parts_{folder.name}"
    sys.modules.pop(parts, None)
    (folder / f"{parts}.py").write_text(textwrap.dedent(PARTS.format(width=width)))
    (folder / "model.py").write_text(textwrap.dedent(ENTRY.format(tokens=tokens, parts=parts)))
    return f"{folder / 'model.py'}:workload"


def target(entry: str) -> Target:
    return Target(entry=entry, hardware="h100-80gb", gpus=2, global_batch=16)


def ranked(entry: str) -> list[dict]:
    return [c.to_dict() for c in estimate_target(target(entry)).candidates]


def test_warm_plan_is_the_cold_one_without_loading_the_workload(cache_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    entry = write_entry(tmp_path / "a")
    cold = ranked(entry)
    assert list(cache_dir.glob("source-*.json")), "the cold plan recorded its sources"
    setup = prepare(target(entry))
    assert isinstance(setup.workload, SourcePlannedWorkload)
    plan = setup.plan()
    assert setup.workload._loaded is None, "a warm plan loaded the workload"
    assert plan.name == "small"
    assert ranked(entry) == cold
    assert setup.loaded_workload.name == "small"  # what needs the real workload still gets it
    monkeypatch.setenv(TRACE_WORKERS_ENV, "0")  # a bad setting fails a warm plan as it fails a cold one
    with pytest.raises(AutofitError, match="AUTOFIT_TRACE_WORKERS='0'"):
        ranked(entry)


def test_changed_sources_or_request_miss(cache_dir: Path, tmp_path: Path) -> None:
    entry = write_entry(tmp_path / "b")
    key = source_key(entry)
    assert key is not None and source_key(entry) == key
    model = tmp_path / "b" / "model.py"
    model.write_text(model.read_text() + "\n# edited\n")
    edited = source_key(entry)
    assert edited != key
    parts = tmp_path / "b" / "parts_b.py"
    parts.write_text(parts.read_text().replace("WIDTH = 32", "WIDTH = 48"))
    assert source_key(entry) not in (key, edited)
    (tmp_path / "b" / "unrelated.py").write_text("x = 1\n")  # not imported: no change
    assert source_key(entry) == source_key(entry)


@pytest.mark.slow
def test_a_changed_sibling_re_plans(cache_dir: Path, tmp_path: Path) -> None:
    entry = write_entry(tmp_path / "c", width=32)
    narrow = ranked(entry)
    write_entry(tmp_path / "c", width=64)
    setup = prepare(target(entry))
    assert setup.workload._loaded is not None, "a miss loads the workload as without the record"
    wide = ranked(entry)
    assert wide != narrow
    assert wide[0]["predicted"]["peak_bytes"] > narrow[0]["predicted"]["peak_bytes"]


def test_a_changed_request_traces_again(cache_dir: Path, tmp_path: Path) -> None:
    entry = write_entry(tmp_path / "d")
    ranked(entry)
    before = set(cache_dir.glob("source-*.json"))
    other = Target(entry=entry, hardware="h100-80gb", gpus=2, global_batch=16, set_values=("checkpoint_ratio=1.0",))
    estimate_target(other)
    assert len(set(cache_dir.glob("source-*.json")) - before) == 1, "another trace request, another record"


def test_hf_config_and_query_are_in_the_key(cache_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bert"
    shutil.copytree(ROOT / "examples" / "hf_configs" / "bert", folder)
    entry = with_hf_options(f"hf:{folder}", seq_len=64)
    key = source_key(entry)
    assert key is not None
    assert source_key(with_hf_options(f"hf:{folder}", seq_len=128)) != key
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    changed = source_key(entry)
    assert changed != key
    (folder / "modeling_custom.py").write_text("x = 1\n")  # the folder's own code (--trust-remote-code)
    assert source_key(entry) != changed


def test_a_workload_object_or_no_cache_never_uses_it(cache_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    entry = write_entry(tmp_path / "e")
    from autofit.workload.entry import load_workload

    autofit.estimate(load_workload(entry), hardware="h100-80gb", gpus=2, global_batch=16)
    assert not list(cache_dir.glob("source-*.json"))
    monkeypatch.setenv(cache.NO_CACHE_ENV, "1")
    assert source_key(entry) is None
    assert not isinstance(prepare(target(entry)).workload, SourcePlannedWorkload)


def test_a_missing_planning_source_is_hashed_as_absent(cache_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """As the trace cache hashes its sources: a file not there (a trimmed install) is ``<absent>``, not a crash,
    and the key differs from the one with the file."""
    entry = write_entry(tmp_path / "h")
    with_file = source_key(entry)
    source_cache._planning_sources_digest.cache_clear()
    monkeypatch.setattr(source_cache, "PLANNING_SOURCES", (*source_cache.PLANNING_SOURCES, "no_such_file.py"))
    try:
        without = source_key(entry)
    finally:
        source_cache._planning_sources_digest.cache_clear()
    assert without is not None and without != with_file


def test_a_corrupt_record_is_ignored(cache_dir: Path, tmp_path: Path) -> None:
    entry = write_entry(tmp_path / "f")
    cold = ranked(entry)
    for record in cache_dir.glob("source-*.json"):
        record.write_text(record.read_text()[:20])
    assert ranked(entry) == cold
    for record in cache_dir.glob("source-*.json"):
        json.loads(record.read_text())  # rewritten whole
    assert ranked(entry) == cold
    summary = next(r for r in cache_dir.glob("source-*.json") if "workload" in json.loads(r.read_text()))
    record = json.loads(summary.read_text())
    summary.write_text(json.dumps({**record, "workload": {**record["workload"], "searches_attention": "yes"}}))
    setup = prepare(target(entry))
    assert setup.workload._loaded is not None, "a record of another layout is a miss"
    assert ranked(entry) == cold


def test_the_ladder_plans_warm_as_cold(cache_dir: Path, tmp_path: Path) -> None:
    entry = write_entry(tmp_path / "g")
    cold = [row.to_dict() for row in autofit.ladder(entry, hardware="h100-80gb", gpus=2, global_batch=16).rows]
    setup = prepare(target(entry))
    from autofit.planning.ladder import run_ladder

    warm = run_ladder(setup)
    assert setup.workload._loaded is None, "a warm ladder loaded the workload"
    assert [row.to_dict() for row in warm.rows] == cold


def test_an_hf_entrys_lengths_are_read_from_its_config_once_and_kept(cache_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """What the plan says of an ``hf:`` entry's sequence (a length past its positions) is kept under its source key:
    a warm plan says it without reading the config again; a record of another layout is read again; a vision
    entry (no lengths) is kept as none."""
    folder = tmp_path / "llama"
    shutil.copytree(ROOT / "examples" / "hf_configs" / "llama_gqa", folder)
    entry = with_hf_options(f"hf:{folder}", seq_len=4096)  # past its 128 positions: a note and a warning
    reads: list[str] = []
    read = source_cache.entry_lengths
    monkeypatch.setattr(source_cache, "entry_lengths", lambda e: reads.append(e) or read(e))
    first = source_cache.recorded_entry_lengths(entry)
    assert first is not None and first == read(entry) and first.warnings and reads == [entry]
    assert source_cache.recorded_entry_lengths(entry) == first and reads == [entry]
    kept = next(cache_dir.glob("lengths-*.json"))
    for edited in ({"lengths": ["4096"], "notes": [], "warnings": []}, {"notes": []}, {"lengths": 4096, "notes": [],
                                                                                     "warnings": []}):
        kept.write_text(json.dumps({"key": kept.stem, "lengths": edited}))
        assert source_cache.recorded_entry_lengths(entry) == first
    assert len(reads) == 4
    vision = tmp_path / "vit"
    shutil.copytree(ROOT / "examples" / "hf_configs" / "vit", vision)
    assert source_cache.recorded_entry_lengths(f"hf:{vision}") is None
    assert source_cache.recorded_entry_lengths(f"hf:{vision}") is None and len(reads) == 5
