"""Issue 40, class 2: numbers that must never be written (NaN, infinities, absurd sizes), refused in one line
by the real CLI, before any trace."""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile_helpers import FIXED, autofit, env, make_entry, one_line_error

from autofit.core.errors import AutofitError
from autofit.core.units import finite, parse_bytes, whole
from autofit.ds.emit import write_json_atomic


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), "nan", "1e309"])
def test_finite_refuses_nan_and_infinities(value: object) -> None:
    with pytest.raises(AutofitError, match="lr must be a finite number"):
        finite("lr", value, 0.0)


def test_whole_and_memory_bounds() -> None:
    with pytest.raises(AutofitError, match="gpus must be at most 1024"):
        whole("gpus", 10**6, 1, 1024)
    for text in ("1" + "0" * 400 + "GiB", "999999999999999GiB", 2**60):
        with pytest.raises(AutofitError, match="larger than any device"):
            parse_bytes(text)  # type: ignore[arg-type]
    assert parse_bytes("80GiB") == 80 * 2**30


def test_json_with_nan_is_never_written(tmp_path: Path) -> None:
    with pytest.raises(AutofitError, match="not a finite number"):
        write_json_atomic(tmp_path / "ds.json", {"optimizer": {"params": {"lr": float("nan")}}})
    assert not (tmp_path / "ds.json").exists()


BAD = [
    (["--lr", "nan"], "lr"), (["--lr", "inf"], "lr"), (["--eps", "nan"], "eps"),
    (["--weight-decay", "inf"], "weight_decay"), (["--momentum", "nan"], "momentum"),
    (["--memory", "1" + "0" * 400 + "GiB"], "memory"), (["--memory", "99999999999GiB"], "memory"),
    (["--global-batch", str(10**24)], "global_batch"), (["--gpus", str(10**6)], "gpus"),
    (["--nodes", str(10**7)], "nodes"), (["--set", "precision=bf16", "--set", "precision=fp32"], "precision"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "word"), BAD, ids=[" ".join(a)[:30] for a, _ in BAD])
def test_estimate_refuses_values_never_written(tmp_path: Path, args: list[str], word: str) -> None:
    res = autofit("estimate", make_entry(tmp_path), *FIXED, *args, "--json", timeout=120)
    assert one_line_error(res, word), (res.returncode, res.stderr[-500:])
    assert "NaN" not in res.stdout and "Infinity" not in res.stdout


@pytest.mark.slow
def test_recipe_from_with_nan_and_trace_workers_and_a_huge_space(tmp_path: Path) -> None:
    entry = make_entry(tmp_path)
    recipe = tmp_path / "ds.json"
    recipe.write_text('{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": NaN}}}')
    res = autofit("estimate", entry, *FIXED[:4], "--recipe-from", str(recipe), "--json")
    assert one_line_error(res, "lr"), res.stderr[-500:]
    res = autofit("estimate", entry, *FIXED, environ=env(AUTOFIT_TRACE_WORKERS="1000000"))
    assert one_line_error(res, "AUTOFIT_TRACE_WORKERS"), res.stderr[-500:]
    space = tmp_path / "huge.yaml"
    space.write_text("global_batch_size: 16\n" + f"checkpoint_ratio: [{', '.join(str(i / 10**4) for i in range(10**4))}]\n"
                     + f"micro_batch_size: [{', '.join(str(i) for i in range(1, 17))}]\n"
                     + "precision: [fp32, bf16]\nzero_stage: [0, 1, 2, 3]\nbucket_scale: [1, 2, 4, 8]\n"
                     + "offload_optimizer: [none, cpu]\n")
    # timeout: a hang guard (alone it answers in seconds; a loaded machine took over 60)
    res = autofit("estimate", entry, "--hardware", "h100-80gb", "--space", str(space), timeout=120)
    assert one_line_error(res, "candidates"), res.stderr[-500:]


@pytest.mark.slow
def test_worker_probe_and_price_numbers(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'q.db'}"
    for args in (["--lease", "nan"], ["--idle-exit", "nan"], ["--idle-exit", "inf"]):
        res = autofit("worker", "--storage", db, "--hardware", "cpu", *args, timeout=60)
        assert res.returncode == 2 and "finite" in res.stderr, (args, res.stderr[-300:])
    res = autofit("probe", make_entry(tmp_path), *FIXED, "--timeout", "-1", timeout=60)
    assert res.returncode == 2 and "finite number > 0" in res.stderr, res.stderr[-300:]
    for price in ("cpu=inf", "cpu=1e999", "cpu=nan"):
        res = autofit("results", "--storage", db, "--price", price, timeout=60)
        assert one_line_error(res, "price"), res.stderr[-300:]
