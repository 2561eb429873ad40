"""A prediction as it travels: the ``predicted`` JSON of docs/design.md ("JSON output"), typed and read back strictly."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.cost_model import predict
from autofit.cost_model.prediction import PredictionRecord
from tests.toy_facts import CPU, FACTS, PRIOR


def test_a_predictions_json_is_the_documented_predicted_object() -> None:
    prediction = predict(Config(micro_batch_size=2, zero_stage=2), FACTS, CPU, 2, PRIOR)
    out = prediction.to_dict()
    assert out == {
        "peak_bytes": prediction.peak_bytes,
        "host_peak_bytes": prediction.host_peak_bytes,
        "breakdown": asdict(prediction.breakdown),
        "step_time_s": prediction.step_time_s,
        "samples_per_s": prediction.samples_per_s,
        "tokens_per_s": prediction.tokens_per_s,
        "time_breakdown": prediction.time_breakdown,
    }
    assert list(out) == ["peak_bytes", "host_peak_bytes", "breakdown", "step_time_s", "samples_per_s", "tokens_per_s",
                         "time_breakdown"]
    assert list(out["breakdown"]) == ["params", "grads", "optimizer", "activations", "other"]
    assert prediction.record().to_json() == out


def test_a_prediction_round_trips_through_its_json() -> None:
    record = predict(Config(micro_batch_size=4), FACTS, CPU, 1, PRIOR).record()
    assert PredictionRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    assert record.breakdown.total == record.peak_bytes


def test_a_predicted_object_with_a_key_renamed_or_mistyped_is_refused_naming_it() -> None:
    data = predict(Config(), FACTS, CPU, 1, PRIOR).to_dict()
    with pytest.raises(AutofitError, match="a prediction has unknown key 'peak'"):
        PredictionRecord.from_json({**{k: v for k, v in data.items() if k != "peak_bytes"}, "peak": 1})
    with pytest.raises(AutofitError, match="missing key 'samples_per_s'"):
        PredictionRecord.from_json({k: v for k, v in data.items() if k != "samples_per_s"})
    with pytest.raises(AutofitError, match="breakdown.*missing key 'grads'"):
        PredictionRecord.from_json(data | {"breakdown": {"params": 1, "optimizer": 1, "activations": 1, "other": 1}})
    with pytest.raises(AutofitError, match="step_time_s must be float"):
        PredictionRecord.from_json(data | {"step_time_s": "fast"})
