"""The trace cache (autofit.trace.cache): a hit gives exactly the fresh trace; a changed model, batch, request,
software or source misses; a corrupt entry or an unwritable directory is traced around, never a crash."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from autofit.core.errors import AutofitError
from autofit.core.space import load_space
from autofit.cost_model import ModelFacts
from autofit.machine.device import get_hardware
from autofit.planning.estimate import estimate
from autofit.planning.plan import Plan
from autofit.trace import cache, trace_workload, tracer
from autofit.workload.types import Workload


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Small(nn.Module):
    def __init__(self, width: int = 32, n_layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def _batch(n: int, tokens: int = 16, width: int = 32) -> torch.Tensor:
    return torch.randn(n, tokens, width)


def small(width: int = 32, tokens: int = 16) -> Workload:
    return Workload(model=functools.partial(Small, width), batch=functools.partial(_batch, tokens=tokens, width=width),
                    name="small")


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache on, in a directory of this test's own."""
    monkeypatch.delenv(cache.NO_CACHE_ENV, raising=False)
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "traces"


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The workload names actually traced (not read from the cache), in order."""
    seen: list[str] = []
    real = tracer._trace_workload

    def counting(workload: Workload, *args: object) -> ModelFacts:
        seen.append(workload.name or "")
        return real(workload, *args)

    monkeypatch.setattr(tracer, "_trace_workload", counting)
    return seen


def trace(workload: Workload, **request: object) -> ModelFacts:
    """One traced micro-batch unless asked (fast): what the cache is keyed by is the same."""
    return trace_workload(workload, **{"micro_batches": (1,), **request})  # type: ignore[arg-type]


def _same(a: ModelFacts, b: ModelFacts) -> bool:
    return replace(a, trace_seconds=0.0) == replace(b, trace_seconds=0.0)


@pytest.mark.slow  # three plans of the default space (~6 s here on a loaded machine)
def test_a_hit_is_exactly_the_fresh_trace_and_prices_the_same_plan(cache_dir: Path, traces: list[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    h100, space = get_hardware("h100-80gb"), load_space("default")
    fixed = {"checkpoint_ratio": 0.0, "grad_accum_steps": 1}  # two steps to trace, enough to compare
    first = Plan.make("small", small(), h100, space, global_batch=16, fixed=fixed)
    second = Plan.make("small", small(), h100, space, global_batch=16, fixed=fixed)
    assert traces == ["small"]  # the second plan read the trace
    assert len(list(cache_dir.glob("*.json"))) == 1 and not list(cache_dir.glob(".*.tmp"))
    monkeypatch.setenv(cache.NO_CACHE_ENV, "1")
    fresh = Plan.make("small", small(), h100, space, global_batch=16, fixed=fixed)
    assert traces == ["small", "small"]
    assert _same(second.facts, fresh.facts) and _same(first.facts, fresh.facts)
    assert second.facts.profiles and second.facts.trace_mode == "fake"
    ranked = [(c.config, c.prediction) for c in estimate(second).candidates]
    assert ranked == [(c.config, c.prediction) for c in estimate(fresh).candidates]


def test_a_changed_shape_batch_dtype_or_request_misses(cache_dir: Path, traces: list[str]) -> None:
    fresh = trace(small())
    hit = trace(small())
    assert len(traces) == 1
    assert _same(hit, fresh) and hit.profiles  # read back from JSON: the same values and types
    trace(small(width=48))  # parameter shapes
    trace(small(tokens=24))  # input shapes
    trace(small(), precisions=("bf16",))  # traced dtype
    trace(small(), micro_batches=(1, 2))
    trace(small(), checkpoint_ratios=(0.0, 1.0))
    assert len(traces) == 6
    assert len(list(cache_dir.glob("*.json"))) == 6


def test_other_software_or_autofit_sources_miss(cache_dir: Path, traces: list[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    trace(small())
    versions = cache.software_versions()
    assert versions["torch"] == torch.__version__.split("+")[0] or versions["torch"] == torch.__version__
    assert {"transformers", "deepspeed", "autofit", "autofit_sources", "python"} <= set(versions)
    monkeypatch.setattr(cache, "software_versions", lambda: {**versions, "torch": "0.0.1"})
    trace(small())
    monkeypatch.setattr(cache, "software_versions", lambda: {**versions, "autofit_sources": "edited"})
    trace(small())
    monkeypatch.setattr(cache, "software_versions", lambda: versions)
    trace(small())
    assert len(traces) == 3  # the last one is the first one's entry again


def test_the_key_follows_settings_and_ties_not_only_shapes() -> None:
    def fingerprint(**changes: object) -> str:
        model = Small()
        for name, value in changes.items():
            setattr(model.layers[1], name, value)
        return cache.model_fingerprint(model)

    assert fingerprint() == fingerprint()
    assert fingerprint(dropout_p=0.1) != fingerprint()  # a plain setting of a module
    tied, untied = Small(), Small()
    tied.layers[1].up.weight = tied.layers[0].up.weight
    untied.layers[1].up.weight = nn.Parameter(torch.empty_like(untied.layers[0].up.weight))
    assert cache.model_fingerprint(tied) != cache.model_fingerprint(untied)


def test_a_corrupt_entry_is_traced_again_and_rewritten(cache_dir: Path, traces: list[str]) -> None:
    good = trace(small())
    (entry,) = cache_dir.glob("*.json")
    garbage = ("{not json", json.dumps({"key": entry.stem, "facts": {"name": "x"}}), "", json.dumps([entry.stem]),
               json.dumps({"key": "another", "facts": json.loads(entry.read_text())["facts"]}))
    for text in garbage:
        entry.write_text(text)
        again = trace(small())
        assert _same(again, good)
    entry.write_bytes(b"\xff\xfe not UTF-8")
    assert _same(trace(small()), good)
    assert len(traces) == 2 + len(garbage)
    assert json.loads(entry.read_text())["key"] == entry.stem  # rewritten whole
    trace(small())
    assert len(traces) == 2 + len(garbage)


def test_an_unwritable_cache_or_no_cache_leaves_nothing(tmp_path: Path, traces: list[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cache.NO_CACHE_ENV, raising=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(blocker))  # traces/ cannot be made under a file
    trace(small())
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "off"))
    monkeypatch.setenv(cache.NO_CACHE_ENV, "1")
    trace(small())
    assert cache.cache_dir() is None and not (tmp_path / "off").exists()
    assert len(traces) == 2


def test_the_default_directory_is_the_xdg_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(cache.NO_CACHE_ENV, raising=False)
    monkeypatch.delenv(cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / "autofit" / "traces"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.cache_dir() == tmp_path / ".cache" / "autofit" / "traces"


@pytest.mark.parametrize(("value", "off"), [("1", True), ("TRUE", True), ("yes", True), ("On", True), ("", False),
                                            ("0", False), ("false", False), ("No", False), ("OFF", False)])
def test_no_cache_reads_the_usual_yes_and_no_spellings(value: str, off: bool, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(cache.NO_CACHE_ENV, value)
    assert cache.cache_dir() == (None if off else tmp_path / "traces")


@pytest.mark.parametrize("value", ["maybe", "2", "disable"])
def test_no_cache_of_another_value_is_one_line_from_the_cli(value: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither on nor off guessed: the variable and its value on one line, exit 1, nothing written."""
    from click.testing import CliRunner

    from autofit.cli import main

    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(cache.NO_CACHE_ENV, value)
    with pytest.raises(AutofitError, match=f"AUTOFIT_NO_CACHE='{value}' is not a yes/no value"):
        cache.cache_dir()
    mlp = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"
    result = CliRunner().invoke(main, ["estimate", f"{mlp}:workload", "--hardware", "cpu"])
    assert result.exit_code == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"autofit: error: AUTOFIT_NO_CACHE='{value}'")
    assert not (tmp_path / "cache").exists()


def test_turned_off_holds_for_what_runs_inside_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cache.NO_CACHE_ENV, raising=False)
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    with cache.turned_off():
        assert cache.cache_dir() is None
        with cache.turned_off(False):  # an inner "no" does not turn it back on
            assert cache.cache_dir() is None
    with cache.turned_off(False):
        assert cache.cache_dir() == tmp_path / "traces"
    assert cache.cache_dir() == tmp_path / "traces"


def test_the_no_cache_flag_is_a_value_of_the_command_not_the_environment(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-cache turns the cache off for its command (cache.turned_off) and leaves os.environ as it was."""
    import os

    from click.testing import CliRunner

    from autofit.cli import main

    monkeypatch.delenv(cache.NO_CACHE_ENV, raising=False)
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    seen: list[Path | None] = []

    def prepare(*args: object) -> None:  # what the command's trace would read, then stop before tracing
        seen.append(cache.cache_dir())
        raise AutofitError("stopped")

    monkeypatch.setattr("autofit.commands.estimate.prepare", prepare)
    mlp = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"
    before = dict(os.environ)
    for flags in (["--no-cache"], []):
        result = CliRunner().invoke(main, ["estimate", f"{mlp}:workload", "--hardware", "cpu", *flags])
        assert result.exit_code == 1 and result.stderr == "autofit: error: stopped\n"
    assert seen == [None, tmp_path / "traces"] and dict(os.environ) == before
