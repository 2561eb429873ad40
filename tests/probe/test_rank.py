"""A probe rank's result (``rank<R>.json``) as a record: written whole, read strictly, never read as a 0."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.machine.device import get_hardware
from autofit.probe.launch import RankOutcome, launch
from autofit.probe.records import RankResult, read_rank_result, write_rank_result
from autofit.probe.run import _combine
from autofit.probe.spec import probe_spec

HERE = Path(__file__).resolve().parent
ENTRY = f"{HERE / 'probe_workloads.py'}:tiny"
CPU = get_hardware("cpu")


def _measured(rank: int = 0) -> RankResult:
    return RankResult(
        rank=rank, status="ok", peak_bytes=12_345, phases_s={"imports_s": 1.5, "steps_s": 0.25},
        step_times_s=[0.1, 0.12, 0.11], step_time_s=0.11, optimizer_time_s=0.02, loss=2.5,
        device_memory={"nvml_peak_bytes": None, "context_bytes": 500}, n_checkpointed=2,
        optimizer_state_bytes=4096, tokens_per_sample=16, build_peak_bytes=1000, initialize_peak_bytes=2000,
        param_elements=300,
    )


def test_a_rank_result_round_trips_through_its_json_file(tmp_path: Path) -> None:
    result = _measured()
    write_rank_result(tmp_path / "rank0.json", result)
    assert read_rank_result(tmp_path / "rank0.json", 0) == result
    assert RankResult.from_json(json.loads(json.dumps(result.to_json()))) == result


def test_a_loss_that_is_not_finite_survives_the_file(tmp_path: Path) -> None:
    result = RankResult(rank=1, status="error", message="the loss was nan", loss=float("nan"))
    write_rank_result(tmp_path / "rank1.json", result)
    back = read_rank_result(tmp_path / "rank1.json", 1)
    assert back is not None and back.status == "error" and back.loss is not None and math.isnan(back.loss)


def test_a_missing_key_is_named() -> None:
    data = _measured().to_json()
    del data["peak_bytes"]
    with pytest.raises(AutofitError, match="missing key 'peak_bytes'"):
        RankResult.from_json(data)


def test_an_unknown_key_is_named() -> None:
    data = _measured().to_json() | {"peak_bytez": 1}
    with pytest.raises(AutofitError, match="unknown key 'peak_bytez'"):
        RankResult.from_json(data)


@pytest.mark.parametrize(
    ("key", "value"),
    [("peak_bytes", "12345"), ("peak_bytes", True), ("status", "fine"), ("step_times_s", [0.1, "x"]), ("oom_on", "gpu")],
)
def test_a_value_of_the_wrong_type_is_named(key: str, value: object) -> None:
    with pytest.raises(AutofitError, match=key):
        RankResult.from_json(_measured().to_json() | {key: value})


def test_a_file_that_is_not_a_rank_result_reads_as_an_error_saying_why(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text("{not json")
    result = read_rank_result(tmp_path / "rank0.json", 0)
    assert result is not None and result.status == "error" and "rank0.json" in (result.message or "")
    assert read_rank_result(tmp_path / "rank1.json", 1) is None  # no file: the rank wrote nothing


@pytest.mark.slow
def test_a_renamed_key_in_a_real_rank_output_makes_the_probe_an_error(tmp_path: Path) -> None:
    """A fake-mode rank (the real worker process, no DeepSpeed step) writes its file; renamed, the probe reads an
    error that names the key, not a rank that measured 0 bytes."""
    config = Config(micro_batch_size=2)
    spec = probe_spec(ENTRY, config, CPU, 1, mode="fake", steps=1, warmup_steps=0)
    outcomes, timed_out = launch(spec, tmp_path, 1, timeout_s=300.0)
    assert outcomes[0].result is not None and outcomes[0].result.status == "ok", outcomes[0].log_tail
    path = tmp_path / "rank0.json"
    good = _combine(config, [_outcome(path)], False, 1, "fake", 300.0, 1.0)
    assert good.status == "ok" and good.peak_bytes > 0

    data = json.loads(path.read_text())
    data["peak_byte"] = data.pop("peak_bytes")
    path.write_text(json.dumps(data))
    bad = _combine(config, [_outcome(path)], False, 1, "fake", 300.0, 1.0)
    assert bad.status == "error"
    assert bad.message is not None and "peak_byte" in bad.message and "rank0.json" in bad.message


def _outcome(path: Path) -> RankOutcome:
    return RankOutcome(0, 0, read_rank_result(path, 0), "")


def test_a_warm_up_step_has_settled_once_it_took_about_what_the_one_before_did() -> None:
    from autofit.probe.rank.steps import SETTLE_TOLERANCE, settled

    assert not settled([])
    assert not settled([0.5])  # one step: whether it was a slow first one is unknown
    assert not settled([2.0, 1.0])  # the first step's extra time
    assert settled([2.0, 1.0, 1.0 + SETTLE_TOLERANCE / 2])
    assert not settled([1.0, 1.0 + 2 * SETTLE_TOLERANCE])
