"""Issue 40, class 4: a cache that lies. Folders private to their user (else ignored, one line), entries
validated before they are believed (a garbled or forged one is traced again, one line naming its file)."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest
from hostile_helpers import FIXED, autofit, env, make_entry
from toy_facts import FACTS

from autofit.cost_model.facts import InvalidFacts, ModelFacts
from autofit.trace.cache_trust import SHARED_CACHE_ENV, distrust, make_private


def test_the_cache_folders_autofit_makes_are_private(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        make_private(tmp_path / "home" / "autofit" / "traces")
    finally:
        os.umask(old)
    for folder in (tmp_path / "home" / "autofit", tmp_path / "home" / "autofit" / "traces"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert distrust(tmp_path / "home" / "autofit" / "traces") is None


def test_a_cache_others_can_write_or_own_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    traces = tmp_path / "c" / "traces"
    make_private(traces)
    monkeypatch.delenv(SHARED_CACHE_ENV, raising=False)
    traces.chmod(0o770)
    assert "writable by its group" in str(distrust(traces))
    monkeypatch.setenv(SHARED_CACHE_ENV, "1")
    assert distrust(traces) is None  # shared on purpose
    traces.parent.chmod(0o777)
    assert "writable by everyone" in str(distrust(traces))  # never, even shared
    traces.parent.chmod(0o700)
    if os.getuid() == 0:
        os.chown(traces, 65534, 65534)
        assert distrust(traces) is None
        monkeypatch.delenv(SHARED_CACHE_ENV)
        assert "belongs to another user" in str(distrust(traces))


@pytest.mark.parametrize(("field", "value", "words"), [
    ("n_params", "lots", "n_params='lots' is not an integer"), ("n_params", -1, "n_params=-1"),
    ("trace_seconds", math.nan, "not a finite number"), ("surprise", 1, "unknown field"),
    ("profiles", [], "profiles=[] is not a dict"),
])
def test_facts_from_a_dict_are_validated(field: str, value: object, words: str) -> None:
    data = FACTS.to_dict()
    data[field] = value
    with pytest.raises(InvalidFacts, match=words.replace("[", r"\[").replace("]", r"\]")):
        ModelFacts.from_dict(data)


def test_a_negative_or_nan_peak_is_not_believed() -> None:
    facts = FACTS
    assert facts.profiles, "the toy facts have traced points"
    for bad in (-10**12, math.nan, 1.5):
        data = facts.to_dict()
        next(iter(data["profiles"].values()))["points"][0]["peak_without_grads_bytes"] = bad
        with pytest.raises(InvalidFacts, match="peak_without_grads_bytes"):
            ModelFacts.from_dict(json.loads(json.dumps(data)))
    assert ModelFacts.from_dict(facts.to_dict()) == facts


@pytest.mark.slow
def test_a_garbled_or_exposed_cache_is_traced_again_with_one_line(tmp_path: Path) -> None:
    entry = make_entry(tmp_path / "entry")
    root = tmp_path / "cache"
    run_env = env(AUTOFIT_NO_CACHE=None, AUTOFIT_CACHE_DIR=str(root))
    honest = autofit("estimate", entry, *FIXED, "--json", environ=run_env)
    assert honest.returncode == 0, honest.stderr[-400:]
    truth = json.loads(honest.stdout)["candidates"][0]["predicted"]["breakdown"]
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    entries = [f for f in (root / "traces").glob("*.json") if "facts" in json.loads(f.read_text())]
    assert entries
    for f in entries:  # forged: nothing needs memory
        doc = json.loads(f.read_text())
        for profile in doc["facts"]["profiles"].values():
            for point in profile["points"]:
                point["peak_without_grads_bytes"] = point["peak_with_grads_bytes"] = point["activation_bytes"] = -1
        f.write_text(json.dumps(doc))
    res = autofit("estimate", entry, *FIXED, "--json", environ=run_env)
    assert res.returncode == 0 and "ignored cache entry" in res.stderr, res.stderr[-400:]
    assert json.loads(res.stdout)["candidates"][0]["predicted"]["breakdown"] == truth
    root.chmod(0o777)
    res = autofit("estimate", entry, *FIXED, "--json", environ=run_env)
    assert res.returncode == 0 and "ignoring the trace cache" in res.stderr, res.stderr[-400:]
    assert json.loads(res.stdout)["candidates"][0]["predicted"]["breakdown"] == truth
