"""The docs' benchmark tables, rendered from ``benchmarks/results/*.json`` when the site is built.

An MkDocs hook (``hooks:`` in mkdocs.yml): a page of ``docs/`` asks for a table with a marker line

    <!-- results: RENDERER FILE[+FILE...] [OPTION...] -->

and :func:`on_page_markdown` replaces it with the table :data:`RENDERERS` makes from those files, so
a re-run benchmark that rewrites its JSON rewrites the docs' table too (no hand-copied figure drifts
from its measurement). :func:`on_files` publishes the benchmarks' PNGs under ``results/img/``.
A marker that names an unknown renderer or a missing file fails the build (``mkdocs build --strict``
or not): a table that cannot be made is an error, not an empty page.

The renderers read the JSON the benchmarks write (benchmarks/accuracy/memory_accuracy.py, search_regret.py,
deepspeed_estimators.py, compare_search.py, compare_memory.py, compare_scale.py) and call
:meth:`autofit.core.config.Config.label` for a config's name; they compute no figure beyond the summary
statistics the benchmarks print (median and worst absolute error, as ``memory_accuracy.summarize``).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20
#: ``<!-- results: RENDERER FILES OPTIONS -->`` on a line of its own
MARKER = re.compile(r"^<!--\s*results:\s*(?P<args>.+?)\s*-->\s*$", re.M)


class TableError(ValueError):
    """A marker that cannot be rendered: unknown renderer, missing file, bad option."""


def table(header: list[str], rows: Iterable[list[Any]], right: int = 1) -> str:
    """A markdown table; columns from ``right`` on are right-aligned."""
    align = ["---" if i < right else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(value: float, sign: bool = True, digits: int = 1) -> str:
    return f"{100 * value:{'+' if sign else ''}.{digits}f}%"


def label(config: dict[str, Any]) -> str:
    """The config's short name, as autofit prints it (``mb4x1 fp32 adamw z0 ckpt0 sdpa``)."""
    from autofit.core.config import Config

    return Config.from_dict(config).label()


def load(name: str) -> Any:
    path = RESULTS / name
    if not path.is_file():
        raise TableError(f"benchmarks/results/{name} does not exist")
    return json.loads(path.read_text())


# --- benchmarks/accuracy/memory_accuracy.py --------------------------------------------------------------

def _rows(data: list[Any]) -> list[dict[str, Any]]:
    return [row for d in data for row in (d["rows"] if isinstance(d, dict) else d)]


def error_groups(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each row's error under ``all``, ``held-out`` and each family ``key=value`` it belongs to."""
    groups: dict[str, list[float]] = {"all": [], "held-out": []}
    for row in rows:
        config = row["config"]
        mb = config["micro_batch_size"]
        families = [f"model={row['model']}", f"precision={config['precision']}", f"optimizer={config['optimizer']}",
                    f"zero_stage={config['zero_stage']}", f"checkpoint_ratio={config['checkpoint_ratio']:g}",
                    "micro_batch=" + ("1-4" if mb <= 4 else "8" if mb <= 8 else "16-32")]
        for key in ["all", *(["held-out"] if row["held_out"] else []), *families]:
            groups.setdefault(key, []).append(row["error"])
    return groups


def memory_summary(data: list[Any], options: dict[str, str]) -> str:
    """Median and worst |error| and the worst under-prediction by group (``groups=all,held-out,...``)."""
    groups = error_groups(_rows(data))
    wanted = options.get("groups", "all,held-out").split(",")
    out = []
    for name in wanted:
        if name not in groups:
            raise TableError(f"no row falls in group {name!r}; groups: {', '.join(groups)}")
        errors = groups[name]
        out.append([name, len(errors), pct(statistics.median(abs(e) for e in errors), sign=False),
                    pct(max(abs(e) for e in errors), sign=False), pct(min(min(errors), 0.0))])
    return table(["group", "configs", "median \\|error\\|", "worst \\|error\\|", "worst under-prediction"], out)


def memory_rows(data: list[Any], options: dict[str, str]) -> str:
    """Every row: predicted and measured MiB and the error (``states=1``: the optimizer's state bytes too)."""
    states = options.get("states") == "1"
    head = ["model", "config", "predicted MiB", "measured MiB", "error"]
    out = []
    for row in _rows(data):
        line = [row["model"], label(row["config"]), f"{row['predicted'] / MIB:.1f}", f"{row['measured'] / MIB:.1f}",
                pct(row["error"])]
        if states:
            line += [f"{row['optimizer_predicted'] / MIB:.2f}", f"{row['optimizer_measured'] / MIB:.2f}"]
        out.append(line)
    if states:
        head += ["optimizer states predicted MiB", "counted MiB"]
    return table(head, out, right=2)


def memory_hf_twins(data: list[Any], options: dict[str, str]) -> str:
    """``--hf-twins`` rows: the ``hf:`` entry's predicted and measured peak, its twin's prediction of the same config."""
    head = ["hf: config", "config", "predicted MiB", "measured MiB", "error", "hand-written twin", "twin predicted MiB",
            "twin error", "hf: vs twin"]
    out = []
    for row in _rows(data):
        twin = "twin" in row
        out.append([row["model"], label(row["config"]), f"{row['predicted'] / MIB:.1f}", f"{row['measured'] / MIB:.1f}",
                     pct(row["error"]), row["twin"] if twin else "none",
                     f"{row['twin_predicted'] / MIB:.1f}" if twin else "-", pct(row["twin_error"]) if twin else "-",
                     pct(row["hf_vs_twin"], digits=2) if twin else "-"])
    return table(head, out, right=2)


# --- benchmarks/search/search_regret.py ------------------------------------------------------------------

def regret(data: list[Any], options: dict[str, str]) -> str:
    """One row a budget: the oracle's best and the emitted config (median samples/s), regret, the search's cost."""
    oracle_s = options.get("oracle_s", "1") == "1"
    head = ["model", "budget", "fitting / space", "oracle best (median samples/s)", "emitted (median samples/s)", "fits",
            "regret", "configs probed (% of space)", "probe runs", "search s"] + (["oracle s"] if oracle_s else [])
    out = []
    for r in _rows(data):
        line = [r["model"], f"{r['budget_mib']:.0f} MiB", f"{r['oracle_fitting']} / {r['space']}",
                f"{r['oracle_config']} ({r['oracle_samples_per_s']:.3g})",
                f"{r['emitted_config']} ({r['emitted_samples_per_s']:.3g})", "yes" if r["emitted_fits"] else "NO",
                pct(r["regret"], sign=False), f"{r['search_configs']} ({r['search_configs_pct']:.0f}%)",
                r["search_probes"], f"{r['search_wall_s']:.0f}"]
        out.append(line + ([f"{r['oracle_wall_s']:.0f}"] if oracle_s else []))
    return table(head, out, right=len(head))


def regret_replay(data: list[Any], options: dict[str, str]) -> str:
    """The same search with every probe answered from the oracle's cache."""
    head = ["model", "budget", "fitting / space", "oracle best (samples/s)", "emitted (samples/s)", "regret", "configs probed"]
    out = [[r["model"], f"{r['budget_mib']:.0f} MiB", f"{r['oracle_fitting']} / {r['space']}",
            f"{r['oracle_config']} ({r['oracle_samples_per_s']:.3g})", f"{r['emitted_config']} ({r['emitted_samples_per_s']:.3g})",
            pct(r["regret"], sign=False), f"{r['search_configs']} ({math.floor(100 * r['search_configs'] / r['space'] + 0.5)}%)"]
           for r in _rows(data)]
    return table(head, out, right=len(head))


# --- benchmarks/peers/deepspeed_estimators.py ----------------------------------------------------------

def deepspeed_estimators(data: list[Any], options: dict[str, str]) -> str:
    """autofit's model states and host memory against DeepSpeed's estimators, per GPU and per node."""
    head = ["model", "ZeRO", "offload", "autofit GiB/GPU", "DeepSpeed GiB/GPU", "diff", "autofit host GiB/node",
            "DeepSpeed host GiB/node"]
    out = []
    for r in _rows(data):
        offload = "none" if not r["offload"] else "optimizer" if r["zero_stage"] < 3 else "optimizer+params"
        out.append([f"{r['model']} ({r['n_params'] / 1e9:.2f} B)", r["zero_stage"], offload, f"{r['autofit_gib']:.2f}",
                    f"{r['deepspeed_gib']:.2f}", pct(r["diff"], digits=0), f"{r['autofit_host_gib']:.0f}",
                    f"{r['deepspeed_host_gib']:.0f}"])
    return table(head, out, right=1)


# --- benchmarks/peers/compare_search.py, compare_memory.py, compare_scale.py ---------------------------

def compare_search(data: list[Any], options: dict[str, str]) -> str:
    """Each tool over the budgets: how often its pick fits, its throughput against the oracle's best."""
    rows = _rows(data)
    tools: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        for tool, pick in r["tools"].items():
            tools.setdefault(tool, []).append(pick)
    out = []
    for tool, picks in tools.items():
        probes = [p["probes"] for p in picks if p.get("probes") is not None]
        walls = [p["wall_s"] for p in picks if p.get("wall_s") is not None]
        out.append([tool, len(picks), sum(bool(p["fits"]) for p in picks),
                    f"{statistics.median(p['relative'] for p in picks):.0%}", f"{min(p['relative'] for p in picks):.0%}",
                    f"{statistics.median(probes):g}" if probes else "-", f"{statistics.median(walls):.0f}" if walls else "-"])
    oracle = [r["oracle"] for r in rows]
    out.append(["oracle: every config probed", len(oracle), len(oracle), "100%", "100%",
                f"{statistics.median(o['probes'] for o in oracle):g}", f"{statistics.median(o['wall_s'] for o in oracle):.0f}"])
    return table(["tool", "budgets", "fits", "median throughput vs oracle", "worst", "median probes", "median wall s"], out)


def compare_memory(data: list[Any], options: dict[str, str]) -> str:
    """Each estimator's error against the probe's measured peak."""
    rows = _rows(data)
    out = []
    for tool in rows[0]["errors"]:
        errors = [r["errors"][tool] for r in rows if r["errors"].get(tool) is not None]
        out.append([tool, len(errors), pct(statistics.median(abs(e) for e in errors), sign=False),
                    pct(max(abs(e) for e in errors), sign=False), pct(min(min(errors), 0.0))])
    return table(["estimator", "configs with a number", "median \\|error\\|", "worst \\|error\\|", "worst under-prediction"], out)


def compare_scale(data: list[Any], options: dict[str, str]) -> str:
    """``part=candidates``: pricing time as the space grows; ``part=sizes``: a whole estimate by model size."""
    result = data[0]
    if options.get("part", "candidates") == "sizes":
        return table(["model", "parameters", "candidates", "fit 80 GB", "estimate s", "peak RSS MiB"],
                     [[s["size"], f"{s['params'] / 1e9:.2f} B", s["candidates"], s["fitting"], f"{s['estimate_s']:.1f}",
                       f"{s['peak_rss_bytes'] / MIB:.0f}"] for s in result["sizes"]])
    return table(["space", "dimensions", "configs before rules", "candidates priced", "enumerate + price s", "µs per candidate"],
                 [[c["step"], c["dimensions"], f"{c['space_size']:,}", f"{c['candidates']:,}", f"{c['price_s']:.2f}",
                   f"{c['us_per_candidate']:.0f}"] for c in result["candidates"]])


RENDERERS: dict[str, Callable[[list[Any], dict[str, str]], str]] = {
    "memory-summary": memory_summary,
    "memory-rows": memory_rows,
    "memory-hf-twins": memory_hf_twins,
    "regret": regret,
    "regret-replay": regret_replay,
    "deepspeed-estimators": deepspeed_estimators,
    "compare-search": compare_search,
    "compare-memory": compare_memory,
    "compare-scale": compare_scale,
}


def render_marker(args: str) -> str:
    """The table one marker asks for: ``RENDERER FILE[+FILE] [key=value ...]``."""
    words = shlex.split(args)
    if len(words) < 2:
        raise TableError(f"a results marker needs a renderer and a file, but got {args!r}")
    name, files, *rest = words
    if name not in RENDERERS:
        raise TableError(f"unknown results renderer {name!r}; known: {', '.join(RENDERERS)}")
    options = dict(word.partition("=")[::2] for word in rest)
    data = [load(f) for f in files.split("+")]
    sources = ", ".join(f"`benchmarks/results/{f}`" for f in files.split("+"))
    return f"{RENDERERS[name](data, options)}\n\n<small>Generated from {sources} when these docs were built.</small>\n"


def render_page(markdown: str) -> str:
    """Every results marker of a page replaced by its table."""
    return MARKER.sub(lambda m: render_marker(m.group("args")), markdown)


# --- the MkDocs hook -------------------------------------------------------------------------------

def on_page_markdown(markdown: str, **_: Any) -> str:
    return render_page(markdown)


def on_files(files: Any, config: Any, **_: Any) -> Any:
    """The benchmarks' pictures, published as ``results/img/NAME.png`` beside the pages that show them."""
    from mkdocs.structure.files import File

    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"results/img/{png.name}", abs_src_path=str(png)))
    return files
