"""The search report: a folder with ``index.html``, ``report.md`` and three PNG pictures.

- the winner, with the safety margin it was verified under, and the runner-ups;
- predicted vs measured, for every probe (how far the calibrated cost model was off);
- every pruned candidate with its reason, one compact row each;
- ``memory_breakdown.png``: predicted memory by part for the top candidates, measured peak marked;
- ``memory_vs_throughput.png``: every candidate (predicted) and every probe (measured), the device
  budget and the usable budget drawn as lines;
- ``timeline.png``: each probe as a bar in time, coloured by outcome, with the best so far;
- on CUDA, ``memory_snapshot.pickle``: the winner's allocator history (:mod:`autofit.probe.snapshot`), with
  a ``PYTORCH_CUDA_ALLOC_CONF`` suggestion when its probe saw fragmentation.

Matplotlib runs with the Agg backend (no display needed).
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autofit.core.config import Config
from autofit.core.recipe import Difference, differences, recipe_line
from autofit.core.software import Software
from autofit.core.units import format_bytes
from autofit.ds.emit import write_text_atomic
from autofit.probe.snapshot import fragmentation_advice
from autofit.report.ladder import ladder_chart, ladder_section, search_ladder
from autofit.report.plots import pyplot as _pyplot

if TYPE_CHECKING:
    from autofit.planning.ladder import Ladder
    from autofit.probe.result import ProbeResult
    from autofit.tuner.records import SearchResult, TrialRecord

PARTS = ("params", "grads", "optimizer", "activations", "other")
STATUS_COLORS = {"ok": "#2a9d8f", "oom": "#e63946", "timeout": "#f4a261", "error": "#6c757d"}
#: candidates drawn in the memory breakdown
TOP_N = 8


def write_report(result: SearchResult, report_dir: str | os.PathLike[str], ladder: Ladder | None = None,
                 snapshot: ProbeResult | None = None) -> Path:
    """Write the report into ``report_dir`` (created); returns the path of ``index.html``. ``ladder``
    (:func:`autofit.planning.ladder.search_ladder`): the section that ends it, with ``ladder.png``. ``snapshot``: the
    winner's probe that recorded ``memory_snapshot.pickle`` in the folder (CUDA), said in its own section."""
    folder = Path(report_dir)
    folder.mkdir(parents=True, exist_ok=True)
    pictures = {
        "memory_breakdown.png": "Predicted memory by part, top candidates (measured peak: black tick)",
        "memory_vs_throughput.png": "Memory vs throughput: every candidate (predicted) and every probe (measured)",
        "timeline.png": "Trial timeline",
    }
    _memory_breakdown(result, folder / "memory_breakdown.png")
    _scatter(result, folder / "memory_vs_throughput.png")
    _timeline(result, folder / "timeline.png")
    sections = report_sections(result) + ([snapshot_section(snapshot)] if snapshot is not None else [])
    last = _ladder_part(result, ladder, folder)

    write_text_atomic(folder / "report.md", _markdown(sections) + (_markdown([last], LADDER_PICTURE) if last else ""))
    index = folder / "index.html"
    write_text_atomic(index, _html(sections, pictures, last))
    return index


LADDER_PICTURE = {"ladder.png": "The ladder: predicted peak and samples/s per rung, and the winner (measured: black)"}


def _ladder_part(result: SearchResult, ladder: Ladder | None, folder: Path) -> tuple[str, str, list[str], list[list[str]]] | None:
    """The ladder's section, its chart drawn into ``folder``; None without a ladder."""
    if ladder is None:
        return None

    ladder_chart(search_ladder(ladder, result), folder / "ladder.png",
                 winner=(result.config.label(), result.predicted, result.measured.to_json()))
    return ladder_section(ladder, result)


PVM_HEADER = ["trial", "phase", "config", "status", "pred. peak", "meas. peak", "peak ratio", "pred. samples/s",
              "meas. samples/s", "compile s", "wall s"]
PRUNED_TEXT = (
    "Candidates never probed: memory (predicted past the usable budget), dominated (predicted "
    "slower than the winner) or rule (a space rule refused the partial config)."
)


def report_sections(result: SearchResult) -> list[tuple[str, str, list[str], list[list[str]]]]:
    """``(title, paragraph, header, rows)`` for each table of the report."""
    config_rows = [[k, str(v)] for k, v in result.config.to_dict().items()]
    runner_rows = [
        [str(i + 1), t.config.label(), _num(t.samples_per_s), format_bytes(t.peak_bytes)]
        for i, t in enumerate(result.runner_ups())
    ]
    pruned_rows = [[p["kind"], _partial_label(p["config"]), p["reason"]] for p in result.pruned]
    return [
        ("Winner", _winner_text(result), ["key", "value"], config_rows),
        ("Recipe", recipe_text(result), ["key", "recipe", "winner", "what it means"],
         [[d.key, d.recipe, d.value, d.meaning] for d in _differs(result)]),
        ("Runner-ups", "Other configs measured within the usable budget, fastest first.",
         ["#", "config", "samples/s", "peak"], runner_rows),
        ("Predicted vs measured", "Every probe; the prediction is the calibrated one the search held when it chose it.",
         PVM_HEADER, [_pvm_row(t) for t in result.trials]),
        ("Calibrated coefficients", "Fitted from the probes (autofit.cost_model.calibrate).",
         ["coefficient", "value"], _calibration_rows(result)),
        ("Pruned", PRUNED_TEXT, ["kind", "config", "reason"], pruned_rows),
    ]


def _differs(result: SearchResult) -> tuple[Difference, ...]:
    """What the winner changes of the search's recipe (empty without one)."""
    return () if result.recipe is None else differences(result.recipe, result.config)


def recipe_text(result: SearchResult) -> str:
    """What the winner keeps of the search's recipe (the one its JSON was written for), in words."""
    if result.recipe is None:
        return "The JSON states no recipe."

    kept = ("The winner trains the recipe exactly: only what computes the same training was searched."
            if not _differs(result) else
            "The winner differs from the recipe as the table says (substitutes allowed with --allow).")
    return f"{recipe_line(result.recipe.to_dict())}. {kept}{software_text(result.software)}"


def software_text(software: Software | None) -> str:
    """What the rules assumed of the target's software, as one sentence; empty without."""
    return "" if software is None else f" Judged by the target's software: {software.summary()}."


def snapshot_section(snapshot: ProbeResult) -> tuple[str, str, list[str], list[list[str]]]:
    """The winner's CUDA memory snapshot: where it is, the allocator's peaks, and the fragmentation advice."""

    memory = snapshot.device_memory
    advice = fragmentation_advice(memory) or "reserved is close to allocated: no sign of fragmentation."
    text = (
        f"The winner probed once more ({snapshot.status}) with the caching allocator's history recorded: "
        f"memory_snapshot.pickle in this folder, to open at https://pytorch.org/memory_viz. {advice}"
    )
    rows = [[key, format_bytes(int(value))] for key in
            ("max_memory_allocated_bytes", "max_memory_reserved_bytes", "nvml_peak_bytes", "context_bytes")
            if (value := memory.get(key)) is not None]
    return ("CUDA memory snapshot", text, ["allocator figure", "bytes"], rows)


def _winner_text(result: SearchResult) -> str:
    m = result.measured
    budget = result.hardware.memory_bytes
    return (
        f"{result.config.label()} on {result.world_size} x {result.hardware.name}: "
        f"{_num(m.samples_per_s)} samples/s measured, peak {format_bytes(m.peak_bytes)} "
        f"of {format_bytes(budget)}. Verified by a probe of its own with a safety margin of {result.margin:.0%}: "
        f"its measured peak must stay within {format_bytes(result.usable_bytes)} "
        f"((1 - {result.margin:g}) x {format_bytes(budget)}). "
        f"{result.n_probes} probes for {result.n_candidates} candidates "
        f"({100 * result.n_search_probes / max(1, result.n_candidates):.1f}% of the space searched); "
        f"stopped: {result.stop_reason}. Study {result.study_name!r} in {result.storage} "
        f"(open it with `optuna-dashboard {result.storage}`). DeepSpeed JSON: {result.out_path or 'not written'}."
    )


def _calibration_rows(result: SearchResult) -> list[list[str]]:
    coeff = result.calibration.coefficients
    rows = [[f"compute_efficiency[{d}]", f"{v:.4g}"] for d, v in coeff.compute_efficiency.items()]
    rows += [
        ["micro_batch_overhead_s", f"{coeff.micro_batch_overhead_s:.4g}"],
        ["step_overhead_s", f"{coeff.step_overhead_s:.4g}"],
        ["optimizer_bytes_per_s", f"{coeff.optimizer_bytes_per_s:.4g}"],
        ["memory_scale", f"{coeff.memory_scale:.4g}"],
    ]
    return rows + [[f"time_factor[{k}]", f"{v:.3g}"] for k, v in result.calibration.time_factors.items()]


def _pvm_row(t: TrialRecord) -> list[str]:
    pred_peak = t.predicted.peak_bytes if t.predicted is not None else 0
    ratio = f"{t.peak_bytes / pred_peak:.2f}" if pred_peak and t.peak_bytes else "-"
    return [
        str(t.number),
        t.phase + (" (resumed)" if t.resumed else ""),
        t.config.label(),
        t.status + ("" if t.within_margin or t.status != "ok" else " (past margin)"),
        format_bytes(pred_peak) if pred_peak else "-",
        format_bytes(t.peak_bytes) if t.peak_bytes else "-",
        ratio,
        _num(t.predicted.samples_per_s if t.predicted is not None else None),
        _num(t.samples_per_s) if t.status == "ok" else "-",
        _compile_cell(t),
        f"{t.wall_s:.1f}",
    ]


def _compile_cell(t: TrialRecord) -> str:
    """Seconds of the step that compiled (part of the wall time, not of samples/s); ``-`` where nothing compiled."""
    seconds = t.measured.phases_s.get("compile_s")
    return f"{seconds:.1f}" if seconds is not None else "-"


def _partial_label(values: dict[str, Any]) -> str:
    try:
        config = Config.from_dict(values)
    except Exception:  # a rule's partial config: say its keys
        return " ".join(f"{k}={v}" for k, v in values.items())
    if set(values) >= set(Config.__dataclass_fields__):
        return config.label()
    return " ".join(f"{k}={v}" for k, v in values.items())


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return f"{float(value):.3g}"


def _markdown(sections: list[tuple[str, str, list[str], list[list[str]]]], pictures: dict[str, str] | None = None) -> str:
    """The report's markdown; with ``pictures``, one more part (no page title) ending with those pictures."""
    lines = [] if pictures else ["# autofit report", ""]
    for title, text, header, rows in sections:
        lines += [f"## {title}", "", text, ""]
        if rows:
            lines.append("| " + " | ".join(header) + " |")
            lines.append("|" + "---|" * len(header))
            lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
            lines.append("")
    if pictures:
        return "\n".join(lines + [f"![{cap}]({name})\n" for name, cap in pictures.items()])
    lines += [
        "## Pictures",
        "",
        "![memory](memory_breakdown.png)",
        "",
        "![scatter](memory_vs_throughput.png)",
        "",
        "![timeline](timeline.png)",
        "",
    ]
    return "\n".join(lines)


def _html(sections: list[tuple[str, str, list[str], list[list[str]]]], pictures: dict[str, str],
          last: tuple[str, str, list[str], list[list[str]]] | None = None) -> str:
    e = html.escape
    body = ["<h1>autofit report</h1>"]
    for title, text, header, rows in sections:
        counted = f"{title} ({len(rows)})" if title == "Pruned" else title
        body.append(f"<h2>{e(counted)}</h2><p>{e(text)}</p>")
        body.append(_table(header, rows) if rows or title == "Pruned" else "")
        if title == "Runner-ups":
            body += [
                f'<figure><img src="{e(name)}" alt="{e(cap)}"><figcaption>{e(cap)}</figcaption></figure>'
                for name, cap in pictures.items()
            ]
    if last is not None:
        title, text, header, rows = last
        body += [f"<h2>{e(title)}</h2><p>{e(text)}</p>", _table(header, rows)]
        body += [f'<figure><img src="{e(n)}" alt="{e(c)}"><figcaption>{e(c)}</figcaption></figure>'
                 for n, c in LADDER_PICTURE.items()]
    style = (
        "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;font-size:13px;margin-bottom:1em}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}th{background:#f2f2f2}"
        "img{max-width:100%}figure{margin:1em 0}"
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>autofit report</title>"
        f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n"
    )


def _table(header: list[str], rows: list[list[str]]) -> str:
    if not rows:
        return "<p><em>none</em></p>"
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _memory_breakdown(result: SearchResult, path: Path) -> None:
    plt = _pyplot()
    measured: dict[Config, int] = {}
    for t in result.trials:
        if t.status == "ok":
            measured[t.config] = max(measured.get(t.config, 0), t.peak_bytes)
    # the winner, then the fastest predicted fitting candidates
    chosen = [result.config] + [c for c, p in result.predictions if p.fits and c != result.config]
    chosen = chosen[:TOP_N]
    predictions = dict(result.predictions)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    mib = 2**20
    labels: list[str] = []
    for i, config in enumerate(chosen):
        prediction = predictions.get(config)
        if prediction is None:
            continue
        bottom = 0.0
        parts = prediction.breakdown.__dict__
        for j, part in enumerate(PARTS):
            value = parts.get(part, 0) / mib
            ax.bar(i, value, bottom=bottom, color=f"C{j}", label=part if i == 0 else None)
            bottom += value
        if config in measured:
            ax.plot(
                [i - 0.4, i + 0.4],
                [measured[config] / mib] * 2,
                color="black",
                lw=2,
                label="measured peak" if not any("measured" in str(lab) for lab in labels) else None,
            )
            labels.append("measured")
    ax.axhline(result.hardware.memory_bytes / mib, color="red", ls="-", label="device budget")
    ax.axhline(result.usable_bytes / mib, color="red", ls="--", label=f"usable ({result.margin:.0%} margin)")
    ax.set_xticks(
        range(len(chosen)),
        [("* " if c == result.config else "") + c.label() for c in chosen],
        rotation=30,
        ha="right",
        fontsize=7,
    )
    ax.set_ylabel("MiB")
    ax.set_title("Predicted memory breakdown (calibrated); * = winner")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(plt, fig, path)


def _scatter(result: SearchResult, path: Path) -> None:
    plt = _pyplot()
    mib = 2**20
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = [p.peak_bytes / mib for _, p in result.predictions]
    ys = [p.samples_per_s for _, p in result.predictions]
    ax.scatter(xs, ys, s=10, color="#9db4c0", alpha=0.6, label="candidates (predicted)")
    for status, color in STATUS_COLORS.items():
        pts = [(t.peak_bytes / mib, t.samples_per_s) for t in result.trials if t.status == status and t.peak_bytes]
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=30, color=color, edgecolor="black", label=f"probe: {status}")
    wm = result.measured
    ax.scatter(
        [wm.peak_bytes / mib],
        [wm.samples_per_s],
        marker="*",
        s=250,
        color="gold",
        edgecolor="black",
        zorder=5,
        label="winner",
    )
    ax.axvline(result.hardware.memory_bytes / mib, color="red", label="device budget")
    ax.axvline(result.usable_bytes / mib, color="red", ls="--", label="usable budget")
    ax.set_xlabel("peak memory (MiB)")
    ax.set_ylabel("samples/s")
    ax.set_title("Memory vs throughput")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(plt, fig, path)


def _timeline(result: SearchResult, path: Path) -> None:
    plt = _pyplot()
    trials = [t for t in result.trials if t.started_s > 0]
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.3 * len(trials) + 1)))
    t0 = min((t.started_s for t in trials), default=0.0)
    best = 0.0
    best_line = []
    for i, t in enumerate(trials):
        color = STATUS_COLORS.get(t.status, "#6c757d")
        ax.broken_barh(
            [(t.started_s - t0, max(t.wall_s, 0.1))],
            (i - 0.4, 0.8),
            color=color,
            hatch="//" if t.phase == "verify" else None,
        )
        ax.text(t.started_s - t0 + max(t.wall_s, 0.1), i, f" {t.status} {t.config.label()}", va="center", fontsize=6)
        if t.within_margin:
            best = max(best, t.samples_per_s)
        best_line.append((t.started_s - t0 + t.wall_s, best))
    ax.set_yticks(range(len(trials)), [f"#{t.number} {t.phase}" for t in trials], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first probe")
    ax.set_title("Trial timeline (hatched: verification)")
    if best_line:
        twin = ax.twinx()
        twin.step(*zip(*best_line, strict=True), where="post", color="black", lw=1)
        twin.set_ylabel("best samples/s so far")
    _save(plt, fig, path)


__all__ = ["write_report", "report_sections"]


def _save(plt: Any, fig: Any, path: Path) -> None:
    """Lay ``fig`` out, write it to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
