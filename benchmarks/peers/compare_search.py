"""The search beside the tools people use: autofit, a batch-size finder plus accumulation, DeepSpeed's autotuner.

    python -m benchmarks.peers.compare_search                     # peers cached in benchmarks/results/compare_search_peers.json
    python -m benchmarks.peers.compare_search --models vit --no-autotuner

The models, space (fp32, ZeRO 0, sdpa: micro-batch 1/2/4 x checkpoint ratio x five optimizers, global batch
4) and the three budgets per model are ``benchmarks/search/search_regret.py``'s, read from its committed oracle
cache (``benchmarks/results/oracle``: every config probed once), so no oracle probe runs again. Each tool
picks a config; the yardstick for all of them is the oracle's own probe of that config:

- **throughput vs oracle** = oracle samples/s of the pick / the best oracle samples/s within the usable 90%
  of the budget (as ``search_regret.py --replay``); 0 where the pick does not fit;
- **fits** = the pick's measured peak within the budget (the device: no margin for anyone);
- **probes**: training runs the tool started (autofit: probe processes; Lightning: trials, each a few steps
  in one process; the autotuner: experiments, each a launcher run); **wall s**: the tool's own run.

autofit: the committed ``search_regret_1thread.json`` (the live search, median-of-5 re-measured; run on
7185d17) and ``search_regret_replay.json`` (its decisions with every probe answered from the oracle cache),
not re-run. Lightning's ``scale_batch_size`` (``power``, ``binsearch``) and DeepSpeed's autotuner run as
``compare_search_peers.py`` says (how the budget is imposed on a CPU, and why the autotuner cannot take
one). A found batch size b becomes micro-batch = the largest divisor of the global batch <= b, with the
accumulation that keeps the global batch, AdamW, no checkpointing. Writes ``compare_search.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from autofit.core.config import Config
from autofit.machine.device import get_hardware
from benchmarks import common as cc
from benchmarks.peers import compare_search_peers as peers
from benchmarks.search.oracle import GLOBAL_BATCH, MARGIN, MODELS, budgets, candidate_configs, config_key, run_oracle

TOOLS = ("autofit", "autofit (replay)", "Lightning power", "Lightning binsearch", "DeepSpeed autotuner")


def user_config(micro_batch: int, zero_stage: int = 0) -> Config:
    """What a user runs after a finder said ``micro_batch``: a divisor of the global batch, accumulation to keep it."""
    mb = max(d for d in range(1, GLOBAL_BATCH + 1) if GLOBAL_BATCH % d == 0 and d <= max(micro_batch, 1))
    return Config(micro_batch_size=mb, grad_accum_steps=GLOBAL_BATCH // mb, precision="fp32", optimizer="adamw",
                  zero_stage=zero_stage, checkpoint_ratio=0.0, attention="sdpa")


def committed(name: str) -> list[dict[str, Any]]:
    return json.loads((cc.RESULTS / name).read_text())


def _match(rows: list[dict[str, Any]], model: str, budget: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["model"] == model and abs(r["budget_mib"] - budget / cc.MIB) < 0.01), None)


def picks(model: str, budget: int, cache: cc.JsonCache, autotuner: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Each tool's pick (a config label or a failure) with its probes and wall time."""
    out: dict[str, dict[str, Any]] = {}
    live = _match(committed("search_regret_1thread.json"), model, budget)
    if live:
        out["autofit"] = {"config": live["emitted_config"], "probes": live["search_probes"], "wall_s": live["search_wall_s"]}
    replay = _match(committed("search_regret_replay.json"), model, budget)
    if replay:
        out["autofit (replay)"] = {"config": replay["emitted_config"], "probes": replay["search_configs"], "wall_s": None}
    for mode in ("power", "binsearch"):
        found = cache.get_or_compute(f"lightning {model} {budget} {mode}",
                                     lambda m=mode: peers.run_finder(MODELS[model], budget, m))
        pick = {"probes": len(found.get("trials", [])), "wall_s": found["wall_s"], "found": found.get("found")}
        if found.get("found"):
            pick["config"] = user_config(found["found"]).label()
        else:
            pick["failure"] = found.get("error", "no batch size found")
        out[f"Lightning {mode}"] = pick
    if autotuner is not None:
        if "optimal" in autotuner:
            ds = autotuner["optimal"]
            config = user_config(ds["train_micro_batch_size_per_gpu"], ds.get("zero_optimization", {}).get("stage", 0))
            out["DeepSpeed autotuner"] = {"config": config.label(), "probes": autotuner["n_experiments"],
                                          "wall_s": autotuner["wall_s"], "raw": ds}
        else:
            out["DeepSpeed autotuner"] = {"failure": autotuner["error"], "probes": None, "wall_s": autotuner.get("wall_s")}
    return out


def score(pick: dict[str, Any], oracle: dict[str, Any], best: float, budget: int) -> dict[str, Any]:
    """The oracle's probe of the pick: fits the budget, throughput relative to the oracle's best."""
    point = oracle.get(pick.get("config", ""))
    if point is None:
        return pick | {"fits": False, "relative": 0.0, "note": pick.get("failure", "not in the oracle's space")}
    fits = point["status"] == "ok" and point["peak_bytes"] <= budget
    return pick | {"fits": fits, "peak_mib": point["peak_bytes"] / cc.MIB,
                   "relative": point["samples_per_s"] / best if fits else 0.0}


def model_rows(model: str, cache: cc.JsonCache, autotune: bool, work: Path) -> list[dict[str, Any]]:
    host = get_hardware("cpu")
    configs = candidate_configs(MODELS[model], host)
    points, oracle_s = run_oracle(model, MODELS[model], configs, host, cc.RESULTS / "oracle")
    by_label = {p.config.label(): {"status": p.status, "peak_bytes": p.peak_bytes, "samples_per_s": p.samples_per_s}
                for p in points}
    assert len(by_label) == len({config_key(p.config) for p in points})  # labels name configs one to one here
    key = f"autotuner {model}"
    # --no-autotuner still shows a cached run: it only refuses to start one
    autotuner = cache.get_or_compute(key, lambda: peers.run_autotuner(model, work / model)) if autotune else cache.data.get(key)
    rows = []
    for budget, fitting in budgets(points):
        best = max(fitting, key=lambda r: r.samples_per_s)
        chosen = picks(model, budget, cache, autotuner)
        rows.append({
            "model": model, "budget_mib": budget / cc.MIB, "usable_mib": (1 - MARGIN) * budget / cc.MIB,
            "oracle": {"config": best.config.label(), "samples_per_s": best.samples_per_s, "probes": len(points),
                       "wall_s": oracle_s, "fitting": len(fitting), "space": len(points)},
            "tools": {tool: score(pick, by_label, best.samples_per_s, budget) for tool, pick in chosen.items()},
        })
        print(f"  {model} {budget / cc.MIB:.0f} MiB: " + ", ".join(
            f"{t} {p.get('config', p.get('note'))} {p['relative']:.0%}" for t, p in rows[-1]["tools"].items()), file=sys.stderr)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for tool in TOOLS:
        picked = [r["tools"][tool] for r in rows if tool in r["tools"]]
        if not picked:
            continue
        walls = [p["wall_s"] for p in picked if p.get("wall_s") is not None]
        probes = [p["probes"] for p in picked if p.get("probes") is not None]
        out[tool] = {"n": len(picked), "fits": sum(p["fits"] for p in picked),
                     "median_relative": statistics.median(p["relative"] for p in picked),
                     "worst_relative": min(p["relative"] for p in picked),
                     "median_probes": statistics.median(probes) if probes else None,
                     "median_wall_s": statistics.median(walls) if walls else None}
    return out


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = ["tool", "budgets", "fits", "median throughput vs oracle", "worst", "median probes", "median wall s"]
    lines = [cc.markdown_table(head, [[t, s["n"], s["fits"], f"{s['median_relative']:.0%}", f"{s['worst_relative']:.0%}",
                                       _num(s["median_probes"], "g"), _num(s["median_wall_s"], ".0f")]
                                      for t, s in summary(rows).items()]), ""]
    detail = []
    for r in rows:
        o = r["oracle"]
        detail.append([r["model"], f"{r['budget_mib']:.0f}", "oracle (every config)", f"{o['config']} ({o['samples_per_s']:.3g}/s)",
                       "yes", "100%", o["probes"], f"{o['wall_s']:.0f}"])
        for tool, p in r["tools"].items():
            detail.append([r["model"], f"{r['budget_mib']:.0f}", tool, p.get("config") or p.get("note", "-"),
                           "yes" if p["fits"] else "NO", f"{p['relative']:.0%}", _num(p.get("probes"), "g"),
                           _num(p.get("wall_s"), ".0f")])
    lines.append(cc.markdown_table(["model", "budget MiB", "tool", "pick", "fits", "throughput vs oracle", "probes", "wall s"],
                                   detail, right=4))
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]]) -> Any:
    fig, axes = cc.new_figure(2, width=6.5, height=4.2)
    bars, walls = axes[0]
    tools = [t for t in TOOLS if any(t in r["tools"] for r in rows)]
    width = 0.8 / max(len(tools), 1)
    for i, tool in enumerate(tools):
        xs = [j + i * width for j in range(len(rows))]
        bars.bar(xs, [100 * r["tools"].get(tool, {}).get("relative", 0.0) for r in rows], width, label=tool)
    bars.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))],
                    [f"{r['model']}\n{r['budget_mib']:.0f} MiB" for r in rows], fontsize=7)
    bars.set(ylabel="throughput vs oracle best (%; 0 = does not fit)", title="Search: what each tool picks")
    bars.legend(fontsize=7)
    stats = summary(rows)
    timed = [t for t in tools if stats[t]["median_wall_s"]]
    walls.barh(timed + ["oracle"], [stats[t]["median_wall_s"] for t in timed] +
               [statistics.median(r["oracle"]["wall_s"] for r in rows)], color="tab:grey")
    walls.set(xlabel="median wall seconds per budget (log)", xscale="log", title="Time to a pick")
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,vit,gqa_llama")
    parser.add_argument("--cache", type=Path, default=cc.RESULTS / "compare_search_peers.json")
    parser.add_argument("--no-autotuner", action="store_true", help="start no autotuner run (cached ones are shown)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/autofit-autotune"), help="the autotuner's experiments")
    parser.add_argument("--out-dir", type=Path, default=cc.RESULTS)
    args = parser.parse_args()
    os.chdir(cc.ROOT)
    cache = cc.JsonCache(args.cache)
    rows = [row for m in args.models.split(",") for row in model_rows(m, cache, not args.no_autotuner, args.work)]
    cc.write_results("compare_search", rows, markdown(rows), chart(rows), args.out_dir)


if __name__ == "__main__":
    main()
