"""The report from a search result built by hand (no probe): tables, pictures and index.html."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from toy_facts import CONFIGS, CPU, FACTS, MIB, PRIOR

from autofit.core.recipe import Recipe
from autofit.cost_model import predict
from autofit.cost_model.calibrate import Calibration
from autofit.cost_model.facts import footprint_key
from autofit.ds.emit import deepspeed_config
from autofit.machine.software import detect_software
from autofit.planning.ladder import Ladder, search_ladder
from autofit.planning.plan import default_recipe
from autofit.probe.result import ProbeResult
from autofit.report.folder import report_sections, write_report
from autofit.tuner.records import SearchResult, TrialRecord
from autofit.workload.types import Workload

#: the toy facts as a CPU search holds them: Plan.make measures the kernel footprint of each traced dtype, plain and
#: checkpointed, on a CPU device, so the ladder's plan (which reuses these facts, checkpointed rungs included) has
#: nothing left to measure; without them it started a footprint process per dtype for the entry "toy.py:workload"
#: that does not exist (~6 s each, to learn nothing)
MEASURED = replace(FACTS, kernel_footprint_bytes={
    footprint_key(dtype, checkpointed): size for dtype, size in (("fp32", 12 * MIB), ("bf16", 20 * MIB))
    for checkpointed in (False, True)})


def _result(tmp_path: Path) -> SearchResult:
    usable = CPU.with_memory(int(0.9 * CPU.memory_bytes))
    predictions = sorted(
        ((c, predict(c, MEASURED, usable, 1, PRIOR)) for c in CONFIGS), key=lambda cp: -cp[1].samples_per_s
    )
    trials = []
    for i, (config, p) in enumerate(predictions[:3]):
        status = ("ok", "oom", "ok")[i]
        measured = ProbeResult(config, status, int(p.peak_bytes * 1.1), p.step_time_s * 2,
                               p.samples_per_s / 2 if status == "ok" else 0.0, None, None, 0.0)
        trials.append(
            TrialRecord(
                i, config, "search", status, measured, p.record(), status == "ok", 1000.0 + 10 * i, 8.0, resumed=i == 0
            )
        )
    winner = trials[0]
    trials.append(TrialRecord(3, winner.config, "verify", "ok", winner.measured, winner.predicted, True, 1040.0, 8.0))
    pruned = [{"config": c.to_dict(), "kind": "dominated", "reason": "predicted slower"} for c, _ in predictions[3:]]
    pruned.append({"config": {"precision": "fp8"}, "kind": "rule", "reason": "cpu has no fp8"})
    return SearchResult(
        config=winner.config,
        measured=winner.measured,
        predicted=winner.predicted,
        deepspeed=deepspeed_config(winner.config, 1, "cpu"),
        trials=trials,
        pruned=pruned,
        hardware=CPU,
        world_size=1,
        global_batch=16,
        margin=0.1,
        usable_bytes=usable.memory_bytes,
        n_candidates=len(CONFIGS),
        stop_reason="test",
        storage="sqlite:///autofit.db",
        study_name="s",
        out_path=str(tmp_path / "ds.json"),
        wall_s=50.0,
        calibration=Calibration(PRIOR),
        predictions=predictions,
        facts=MEASURED,
    )


def _search_ladder(result: SearchResult, recipe: Recipe) -> Ladder:
    """The ladder of ``result``'s winner, as ``autofit run`` makes it for its report (no fixed values)."""
    return search_ladder("toy.py:workload", Workload(model=object, batch=list, name="toy"), result.config, {},
                         hardware=result.hardware, world_size=result.world_size, facts=result.facts,
                         margin=result.margin, calibration=result.calibration, recipe=recipe,
                         software=detect_software())


def test_report_writes_tables_pictures_and_an_index(tmp_path: Path) -> None:
    result = _result(tmp_path)
    index = write_report(result, tmp_path / "report")
    html = index.read_text()
    for name in ("memory_breakdown.png", "memory_vs_throughput.png", "timeline.png"):
        png = tmp_path / "report" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f'src="{name}"' in html
    assert "safety margin of 10%" in html
    assert "optuna-dashboard sqlite:///autofit.db" in html
    assert "cpu has no fp8" in html and "predicted slower" in html
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Predicted vs measured" in md and "## Pruned" in md


def test_sections_hold_every_probe_and_every_pruned_candidate(tmp_path: Path) -> None:
    result = _result(tmp_path)
    sections = {title: rows for title, _, _, rows in report_sections(result)}
    assert len(sections["Predicted vs measured"]) == len(result.trials)
    assert len(sections["Pruned"]) == len(result.pruned)
    assert [r[1] for r in sections["Runner-ups"]] == [result.trials[2].config.label()]
    assert any("resumed" in row[1] for row in sections["Predicted vs measured"])


@pytest.mark.slow
def test_the_report_ends_with_the_ladder_and_the_winners_place_in_it(tmp_path: Path) -> None:
    result = _result(tmp_path)
    # the toy facts cover fp32 and bf16, checkpointed and not, footprints measured: the ladder reuses them (no trace)
    ladder = _search_ladder(result, default_recipe(CPU))
    assert ladder.rows[0].config.micro_batch_size == result.config.micro_batch_size
    index = write_report(result, tmp_path / "report", ladder=ladder)
    assert (tmp_path / "report" / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = index.read_text()
    assert 'src="ladder.png"' in html and html.index("<h2>Ladder</h2>") > html.index("<h2>Pruned")
    md = (tmp_path / "report" / "report.md").read_text()
    ladder_md = md[md.index("## Ladder"):]
    assert md.index("## Ladder") > md.index("## Pruned")
    for row in ladder.rows:
        assert f"| {row.index} | {row.rung.name} |" in ladder_md
    assert f"| * | winner | the search's verified pick | {result.config.label()} |" in ladder_md
    assert "The winner" in ladder_md and "![" in ladder_md


@pytest.mark.slow
def test_the_winners_place_names_its_rung_or_how_it_differs(tmp_path: Path) -> None:
    from autofit.report.ladder import winner_place

    result = _result(tmp_path)
    ladder = _search_ladder(result, default_recipe(CPU))
    rung = ladder.rows[2]
    assert winner_place(ladder, rung.config, 1.0) == f"The winner is rung 2 ({rung.rung.name}) of the ladder."
    other = rung.config.with_(optimizer="sgd")
    assert "optimizer=sgd (rung: adamw)" in winner_place(ladder, other, 1.0)


def test_every_row_of_the_ladder_table_has_a_cell_for_each_column(tmp_path: Path) -> None:
    from dataclasses import replace

    from autofit.report.ladder import ladder_section

    result = _result(tmp_path)
    # the search's recipe, whose differences the "vs recipe" column shows (the winner's JSON is written for it)
    recipe = Recipe("sgd", result.config.precision)
    result = replace(result, deepspeed=deepspeed_config(result.config, 1, "cpu", recipe=recipe))
    ladder = _search_ladder(result, recipe)
    _, _, header, rows = ladder_section(ladder, result)
    assert [len(cells) for cells in rows] == [len(header)] * (len(ladder.rows) + 1)
    winner = dict(zip(header, rows[-1], strict=True))
    assert winner["#"] == "*" and winner["config"] == result.config.label()
    assert winner["vs recipe"] == f"not the recipe: {result.config.optimizer} for sgd"
    assert winner["fits"] == "yes" and winner["probe"] == "ok"


def test_the_recipe_section_is_the_searchs_recipe_and_software(tmp_path: Path) -> None:
    from autofit.core.software import Software

    result = _result(tmp_path)
    texts = {title: text for title, text, _, _ in report_sections(result)}
    assert texts["Recipe"] == "The JSON states no recipe."  # a result made by hand
    recipe = Recipe("sgd", result.config.precision)
    result = replace(result, recipe=recipe, software=Software(source="cluster"))
    (_, text, _, rows), = [section for section in report_sections(result) if section[0] == "Recipe"]
    assert text.startswith("recipe: sgd + ") and "differs from the recipe" in text
    assert "Judged by the target's software: cluster (autofit's CUDA-cluster profile)" in text
    assert rows == [["optimizer", "sgd", result.config.optimizer, rows[0][3]]]
