"""The queued request as a typed record: the stored JSON as autofit has always written it, older requests still read,
a malformed one named; "nothing fits" told from other failures by its type."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from queue_helpers import ENTRY, sgd_space

from autofit.core.errors import AutofitError, NothingFits
from autofit.core.recipe import Recipe
from autofit.cost_model.budget import DEFAULT_MARGIN
from autofit.machine.device import get_hardware
from autofit.machine.fingerprint import detect_machine
from autofit.schedule import worker as worker_module
from autofit.schedule.request import SearchRequest
from autofit.schedule.submit import make_request
from autofit.schedule.worker import Worker

#: the keys every request has been stored with (the cache key hashes them: schedule/queue.py, request_key)
STORED_KEYS = ["entry", "hardware", "gpus", "nodes", "global_batch", "space", "space_name", "fixed", "trials",
               "memory_bytes", "margin", "recipe", "sources"]


def _made() -> SearchRequest:
    return make_request(ENTRY, get_hardware("l4"), gpus=2, nodes=1, global_batch=32, space=sgd_space([4, 8]),
                        fixed={"zero_stage": 2, "attention": "sdpa"}, trials=3, memory_bytes=None,
                        recipe=Recipe("sgd", "fp32"), margin=0.2)


def test_the_stored_request_keeps_its_keys_and_reads_back_as_the_same_record() -> None:
    request = _made()
    stored = request.to_dict()
    assert list(stored) == STORED_KEYS
    assert stored["recipe"] == Recipe("sgd", "fp32").to_dict() and list(stored["fixed"]) == ["attention", "zero_stage"]
    assert SearchRequest.from_dict(stored) == request
    assert request.search_space() == sgd_space([4, 8])


def test_a_request_queued_before_the_later_keys_reads_with_their_defaults() -> None:
    old = {k: v for k, v in _made().to_dict().items() if k not in ("memory_bytes", "margin", "recipe", "sources")}
    read = SearchRequest.from_dict(old)
    assert (read.memory_bytes, read.margin, read.recipe, read.sources) == (None, DEFAULT_MARGIN, None, None)


@pytest.mark.parametrize(("change", "named"), [
    ({"trials": "3"}, "trials"), ({"shards": 4}, "shards"), ({"recipe": {"precision": "fp32"}}, "optimizer"),
])
def test_a_malformed_request_is_one_error_naming_the_key(change: dict[str, Any], named: str) -> None:
    with pytest.raises(AutofitError, match=f"the queued request.*{named}"):
        SearchRequest.from_dict(_made().to_dict() | change)
    with pytest.raises(AutofitError, match="missing key 'entry'"):
        SearchRequest.from_dict({k: v for k, v in _made().to_dict().items() if k != "entry"})


@pytest.mark.parametrize(("raised", "state"), [
    (NothingFits("nothing fits l4 within 20 GiB usable"), "nothing-fits"),
    (AutofitError("nothing fits: a message alike is no verdict"), "failed"),
])
def test_the_worker_tells_nothing_fits_by_its_type(raised: AutofitError, state: str, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    request = _made()
    monkeypatch.setattr(worker_module.queue, "study_attrs", lambda url, search_id: {"request": request.to_dict()})
    monkeypatch.setattr(worker_module, "plan_for", lambda *args: SimpleNamespace(margin=request.margin))

    def run_search(*args: Any, **kwargs: Any) -> Any:
        raise raised

    monkeypatch.setattr(worker_module, "run_search", run_search)
    device = get_hardware("cpu")
    worker = Worker(f"sqlite:///{tmp_path / 'unused.db'}", "w", device, detect_machine(device), log=lambda text: None)
    assert worker._search("s-1", lease=None) == (state, str(raised), None)  # type: ignore[arg-type]
