"""``autofit results`` and the ``schedule`` commands on a store with searches of two (three) hardware kinds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from queue_helpers import model_worker, queue_tiny
from tiny import ENTRY

from autofit.cli import main
from autofit.schedule.results import compare, parse_prices


@pytest.fixture(scope="module")
def two_kinds(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model searched on this CPU and on an L4 (a worker answering from the cost model), and queued
    on an H100 no worker has run. Built once for the module (two searches, ~5 s): the tests only read the store."""
    sqlite_url = f"sqlite:///{tmp_path_factory.mktemp('two_kinds') / 'queue.db'}"
    queue_tiny(sqlite_url, hardware="cpu")
    queue_tiny(sqlite_url, hardware="l4", memory_mib=None)
    queue_tiny(sqlite_url, hardware="h100-80gb", memory_mib=None)
    model_worker(sqlite_url, "cpu-worker", "cpu").serve()
    model_worker(sqlite_url, "l4-worker", "l4").serve()
    return sqlite_url


@pytest.mark.slow
def test_results_compare_measured_winners_across_hardware_with_their_cost(two_kinds: str, tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(main, ["results", "--storage", two_kinds, "--price", "l4=0.8", "--price", "h100-80gb=3.5",
                                "--json", "--report", str(tmp_path / "report")])
    assert done.exit_code == 0, done.output
    rows = {r["hardware"]: r for r in json.loads(done.stdout)["results"]}
    assert {h: r["source"] for h, r in rows.items()} == {"cpu": "measured", "l4": "measured", "h100-80gb": "predicted"}
    for r in rows.values():
        assert r["entry"] == ENTRY and r["samples_per_s"] > 0 and 0 < r["headroom_bytes"] < r["memory_bytes"]
    assert rows["cpu"]["usd_per_hour"] is None and rows["cpu"]["usd_per_million_samples"] is None  # no --price cpu
    assert rows["l4"]["usd_per_hour"] == 0.8 and rows["l4"]["usd_per_million_samples"] > 0
    assert rows["l4"]["usd_per_million_tokens"] is None  # the tiny model has no tokens
    twice = {r["hardware"]: r for r in compare(two_kinds, {"l4": 1.6})}
    assert twice["l4"]["usd_per_million_samples"] == pytest.approx(2 * rows["l4"]["usd_per_million_samples"])
    for name in ("results.md", "results.json", "results.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    assert "l4 x1" in (tmp_path / "report" / "results.md").read_text()


@pytest.mark.slow
def test_schedule_list_shows_every_search_with_its_state(two_kinds: str) -> None:
    done = CliRunner().invoke(main, ["schedule", "list", "--storage", two_kinds, "--json"])
    assert done.exit_code == 0, done.output
    searches = {s["hardware"]: s for s in json.loads(done.stdout)["searches"]}
    assert {h: s["state"] for h, s in searches.items()} == {"cpu": "done", "l4": "done", "h100-80gb": "queued"}
    assert searches["l4"]["worker"] == "l4-worker" and searches["l4"]["trials"] >= 1 and searches["l4"]["best"]
    assert searches["h100-80gb"]["best"] is None and searches["h100-80gb"]["worker"] is None


@pytest.mark.slow
def test_schedule_add_prints_json_and_says_the_entry_must_be_importable_by_workers(sqlite_url: str, tmp_path: Path) -> None:
    runner = CliRunner()
    help_text = runner.invoke(main, ["schedule", "add", "--help"]).output
    assert "importable" in help_text and "workers" in help_text
    space = tmp_path / "space.yaml"
    space.write_text("micro_batch_size: [4, 8]\nprecision: [fp32]\noptimizer: [sgd]\nzero_stage: [0]\nattention: [sdpa]\n")
    args = ["schedule", "add", ENTRY, "--hardware", "cpu", "--memory", "1GiB", "--global-batch", "16", "--space",
            str(space), "--set", "optimizer=sgd", "--trials", "2", "--storage", sqlite_url, "--json"]
    first = runner.invoke(main, args)
    assert first.exit_code == 0, first.output
    added = json.loads(first.stdout)
    assert set(added) == {"id", "state", "cached"} and (added["state"], added["cached"]) == ("queued", False)
    assert json.loads(runner.invoke(main, args).stdout) == added


def test_bad_prices_and_hardware_are_one_line_errors(sqlite_url: str) -> None:
    runner = CliRunner()
    done = runner.invoke(main, ["results", "--storage", sqlite_url, "--price", "l4"])
    assert done.exit_code == 1 and "NAME=USD_PER_DEVICE_HOUR" in done.output
    with pytest.raises(Exception, match="--price"):
        parse_prices(["l4=-1"])
    done = runner.invoke(main, ["worker", "--storage", sqlite_url, "--hardware", "tpu"])
    assert done.exit_code == 1 and "unknown hardware" in done.output


@pytest.mark.slow
def test_a_search_whose_study_is_missing_is_shown_as_missing_and_the_rest_still_listed(sqlite_url: str,
                                                                                     tmp_path: Path) -> None:
    import optuna

    from autofit.schedule import queue
    from autofit.schedule.store import optuna_storage

    gone = queue_tiny(sqlite_url, hardware="l4", memory_mib=None)
    kept = queue_tiny(sqlite_url, hardware="h100-80gb", memory_mib=None)
    model_worker(sqlite_url, "l4-worker", "l4").serve()
    optuna.delete_study(study_name=queue.study_name(gone.id), storage=optuna_storage(sqlite_url))
    runner = CliRunner()
    listed = runner.invoke(main, ["schedule", "list", "--storage", sqlite_url, "--json"])
    assert listed.exit_code == 0, listed.output
    states = {s["id"]: s for s in json.loads(listed.stdout)["searches"]}
    assert states[gone.id]["state"] == "missing" and "missing from the store" in states[gone.id]["message"]
    assert states[kept.id]["state"] == "queued"
    assert runner.invoke(main, ["schedule", "list", "--storage", sqlite_url]).exit_code == 0
    shown = runner.invoke(main, ["results", "--storage", sqlite_url, "--json", "--report", str(tmp_path / "r")])
    assert shown.exit_code == 0, shown.output
    rows = {r["hardware"]: r for r in json.loads(shown.stdout)["results"]}
    assert rows["l4"]["source"] == "missing" and rows["h100-80gb"]["source"] == "predicted"
    assert "missing" in (tmp_path / "r" / "results.md").read_text()
    assert runner.invoke(main, ["results", "--storage", sqlite_url]).exit_code == 0
    again = queue_tiny(sqlite_url, hardware="l4", memory_mib=None)  # not "cached" on a study that is gone
    assert (again.state, again.cached) == ("queued", False) and again.id != gone.id


@pytest.mark.slow
def test_the_report_is_replaced_whole_or_not_at_all(two_kinds: str, tmp_path: Path) -> None:
    from autofit.schedule.results import write_results_report

    folder = tmp_path / "report"
    rows = compare(two_kinds)
    write_results_report(rows, folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert set(before) == {"results.json", "results.md", "results.png"}
    broken = [dict(rows[0], samples_per_s="not a number")]  # the table cannot be made: nothing is replaced
    with pytest.raises((TypeError, ValueError)):
        write_results_report(broken, folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # no temporary file left either


@pytest.mark.slow
def test_a_price_for_an_unknown_hardware_name_is_an_error_and_pcie_and_sxm_h100s_are_priced_apart(
        sqlite_url: str) -> None:
    with pytest.raises(Exception, match="unknown hardware 'h100'"):
        parse_prices(["h100=3.9"])
    done = CliRunner().invoke(main, ["results", "--storage", sqlite_url, "--price", "h100-sxm=3.9"])
    assert done.exit_code == 1 and "unknown hardware" in done.output and len(done.output.strip().splitlines()) == 1
    queue_tiny(sqlite_url, hardware="h100-80gb", memory_mib=None)
    queue_tiny(sqlite_url, hardware="h100-pcie-80gb", memory_mib=None)
    model_worker(sqlite_url, "sxm", "h100-80gb").serve()
    model_worker(sqlite_url, "pcie", "h100-pcie-80gb").serve()
    rows = {r["hardware"]: r for r in compare(sqlite_url, parse_prices(["h100-80gb=3.9", "h100-pcie-80gb=2.5"]))}
    assert set(rows) == {"h100-80gb", "h100-pcie-80gb"} and {r["source"] for r in rows.values()} == {"measured"}
    assert (rows["h100-80gb"]["usd_per_hour"], rows["h100-pcie-80gb"]["usd_per_hour"]) == (3.9, 2.5)
    assert rows["h100-pcie-80gb"]["samples_per_s"] < rows["h100-80gb"]["samples_per_s"]  # its own FLOPs and bandwidth
