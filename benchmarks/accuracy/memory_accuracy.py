"""Predicted peak memory vs a real probe (docs/design.md, "Memory, measured"), on several architectures.

    python -m benchmarks.accuracy.memory_accuracy --json benchmarks/results/memory_accuracy.json   # every row
    python -m benchmarks.accuracy.memory_accuracy --quick                                           # 6 rows a model
    python -m benchmarks.accuracy.memory_accuracy --models benchmarks/models/vit.py:workload
    python -m benchmarks.accuracy.memory_accuracy --techniques --json benchmarks/results/memory_accuracy_techniques.json
    python -m benchmarks.accuracy.memory_accuracy --no-techniques --models benchmarks/models/t5_encdec.py:workload  # full grid
    python -m benchmarks.accuracy.memory_accuracy --reprice benchmarks/results/memory_accuracy_full.json  # no probe
    python -m benchmarks.accuracy.memory_accuracy --models 'hf:examples/hf_configs/llama_gqa?seq_len=128'  # an hf: entry
    python -m benchmarks.accuracy.memory_accuracy --hf-twins --json benchmarks/results/memory_accuracy_hf_twins.json

Each row is one config with every key fixed (no key left to a default, checked against the config
keys), through ``deepspeed.initialize`` with its own JSON, CPU, world size 1, one warm-up and one
measured step; error = (predicted - measured) / measured. The full grid covers every ZeRO stage,
fp32/bf16, every optimizer, checkpoint ratios 0/0.5/1 and micro-batches 1 to 32 on every model.
Offload is pruned on a CPU device (the cpu device *is* the host), so no row has it here.
Both grids end with :data:`TECHNIQUE_GRID` (attention-only checkpointing, Adam-mini at ZeRO 0, its one
stage), which ``--techniques`` runs alone; attention-only rows are left out for a model without attention
sub-modules (the ResNet). Each row also has the optimizer's state bytes, predicted and as the probe counted them.

``--reprice FILE`` keeps the measured peaks of a results file and prices its rows again with the cost model
as it is now (each row's ``priced_on``: the commit), so a change to the model is judged on the same
measurements without probing again.

``--models`` takes ``hf:`` entries as ``autofit estimate`` does (a local folder is made absolute, so the
probe's process loads the same one). ``--hf-twins`` runs :data:`TWIN_GRID` on each shipped config of
``examples/hf_configs/`` (:data:`HF_TWINS`) through ``hf:`` -- predicted and measured -- and prices the same
rows on the config's hand-written twin (the same model written as a ``Workload``), so a row says whether the
``hf:`` path predicts what the hand-written entry predicts and how both compare with the measurement.

Prints a markdown table of rows, then the summary by family (median and worst |error|), over every
model and over the held-out ones (those in :data:`HELD_OUT_DIR`: never used to set a constant).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from autofit.core.config import CONFIG_KEYS, Config  # noqa: E402
from autofit.cost_model import predict  # noqa: E402
from autofit.cost_model.states import model_states  # noqa: E402
from autofit.machine.device import get_hardware  # noqa: E402
from autofit.planning.plan import trace_for, with_kernel_footprints  # noqa: E402
from autofit.probe.ops import prepare_ops  # noqa: E402
from autofit.probe.run import run_probe  # noqa: E402
from autofit.probe.spec import probe_spec  # noqa: E402
from autofit.workload.entry import load_workload  # noqa: E402
from autofit.workload.hf import HfEntry, is_hf_entry  # noqa: E402

MODELS = [
    "examples/gpt.py:workload",
    "benchmarks/models/t5_encdec.py:workload",
    "benchmarks/models/vit.py:workload",
    "benchmarks/models/gqa_llama.py:workload",
    "benchmarks/models/moe.py:workload",
    "benchmarks/models/cnn.py:workload",
]
#: where the models live that no constant of the cost model was set on
HELD_OUT_DIR = "benchmarks/models/"
HF_CONFIGS = "examples/hf_configs"
#: each shipped config (as the ``hf:`` entry's options) -> its hand-written twin, the same model and batch
#: (tests/workload/test_hf.py checks their estimates agree); None: no hand-written entry of that model exists
HF_TWINS: dict[str, tuple[str, str | None]] = {
    "llama_gqa": ("seq_len=128", "benchmarks/models/gqa_llama.py:workload"),
    "mixtral_moe": ("seq_len=128", "benchmarks/models/moe.py:workload"),
    "t5_encdec": ("seq_len=128&target_len=64", "benchmarks/models/t5_encdec.py:workload"),
    "bert": ("seq_len=128", "examples/hf_bert.py:workload"),
    "vit": ("", "benchmarks/models/vit.py:workload"),
    "mistral_sliding": ("seq_len=128", None),
    "deepseek_v3_mla": ("seq_len=128", None),
}

#: (zero_stage, precision, optimizer, checkpoint_ratio, micro_batch_size): every stage, both precisions,
#: every optimizer, every ratio and micro-batches 1-32, each value at least twice, no two rows alike
FULL_GRID = [
    (0, "fp32", "adamw", 0.0, 1),
    (1, "bf16", "adamw8bit", 0.5, 2),
    (2, "fp32", "lion", 1.0, 4),
    (3, "bf16", "adafactor", 0.0, 8),
    (0, "bf16", "sgd", 1.0, 16),
    (2, "bf16", "adamw", 0.5, 32),
    (3, "fp32", "adamw8bit", 1.0, 16),
    (1, "fp32", "sgd", 0.0, 32),
    (0, "fp32", "lion", 0.5, 8),
    (1, "fp32", "adafactor", 1.0, 4),
    (3, "fp32", "adamw", 0.5, 32),
    (2, "fp32", "adamw8bit", 0.0, 16),
]
#: (zero_stage, precision, optimizer, checkpoint_ratio, micro_batch_size, checkpoint_granularity): selective
#: checkpointing of every layer's or half the layers' attention, and Adam-mini with and without it
TECHNIQUE_GRID = [
    (0, "fp32", "adamw", 1.0, 4, "attention"),
    (2, "bf16", "adamw", 0.5, 2, "attention"),
    (0, "fp32", "adam_mini", 0.0, 4, "block"),
    (0, "bf16", "adam_mini", 1.0, 2, "attention"),
]
QUICK_GRID = [
    (0, "fp32", "adamw", 0.0, 4),
    (1, "fp32", "adamw", 1.0, 2),
    (2, "fp32", "adamw8bit", 0.5, 4),
    (3, "fp32", "adamw", 0.0, 2),
    (0, "bf16", "adamw", 0.5, 2),
    (2, "bf16", "adamw", 0.0, 4),
]

#: the few rows ``--hf-twins`` runs on each family: fp32 and bf16, ZeRO 0/2/3, no, half and full checkpointing
TWIN_GRID = [
    (0, "fp32", "adamw", 0.0, 4),
    (2, "bf16", "adamw", 0.5, 4),
    (3, "fp32", "adamw", 1.0, 2),
]


def fully_fixed(zero_stage: int, precision: str, optimizer: str, ratio: float, micro_batch: int,
                granularity: str = "block") -> Config:
    """A config with every key written out; fails when a config key is added and not named here."""
    values: dict[str, Any] = {
        "micro_batch_size": micro_batch, "grad_accum_steps": 1, "checkpoint_ratio": ratio,
        "precision": precision, "optimizer": optimizer, "zero_stage": zero_stage,
        "offload_optimizer": "none", "offload_params": "none", "attention": "sdpa",
        "checkpoint_granularity": granularity, "overlap_comm": False, "contiguous_gradients": True, "bucket_scale": 1,
        "compile": "off", "sequence_parallel": 1, "tiled_mlp": False, "tiled_loss": False, "offload_activations": "none",
        "hpz_partition_size": 1, "tensor_parallel": 1, "quantized_weights": False, "quantized_gradients": False,
    }
    missing = set(CONFIG_KEYS) - set(values)
    if missing:
        raise SystemExit(f"memory_accuracy: name every config key in its rows; missing {sorted(missing)}")
    return Config.from_dict(values)


def configs_for(quick: bool, techniques_only: bool = False, with_techniques: bool = True) -> list[Config]:
    grid = [] if techniques_only else QUICK_GRID if quick else FULL_GRID
    return [fully_fixed(*row) for row in [*grid, *(TECHNIQUE_GRID if with_techniques else [])]]


def runnable(configs: list[Config], workload: Any) -> list[Config]:
    """The configs a model can run: attention-only checkpointing only where every repeated layer has attention."""
    if any(c.checkpoint_granularity == "attention" for c in configs) and not workload.checkpoints_attention():
        return [c for c in configs if c.checkpoint_granularity != "attention"]
    return configs


def families(row: dict[str, Any]) -> list[str]:
    """The families a measured row belongs to (one per key the summary groups by)."""
    config = row["config"]
    mb = config["micro_batch_size"]
    return [
        f"precision={config['precision']}", f"optimizer={config['optimizer']}", f"zero_stage={config['zero_stage']}",
        f"checkpoint_ratio={config['checkpoint_ratio']:g}",
        f"checkpoint_granularity={config.get('checkpoint_granularity', 'block')}",
        f"micro_batch={'1-4' if mb <= 4 else '8' if mb == 8 else '16-32'}",
        f"model={row['model']}",
    ]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and worst |error| and the worst under-prediction, over all rows, the held-out ones, and each family."""
    groups: dict[str, list[float]] = {"all": [], "held-out": []}
    for row in rows:
        keys = ["all", *(["held-out"] if row["held_out"] else []), *families(row)]
        for key in keys:
            groups.setdefault(key, []).append(row["error"])
    return [
        {"group": key, "n": len(errors), "median_abs": statistics.median(abs(e) for e in errors),
         "worst_abs": max(abs(e) for e in errors), "worst_under": min(min(errors), 0.0)}
        for key, errors in groups.items() if errors
    ]


def priced(config: Config, facts: Any, hardware: Any, measured_bytes: int) -> dict[str, Any]:
    """A row's predicted fields: the peak, its error against ``measured_bytes``, the optimizer's state bytes."""
    predicted = predict(config, facts, hardware, 1).peak_bytes
    return {"predicted": predicted, "error": (predicted - measured_bytes) / measured_bytes,
            "optimizer_predicted": int(model_states(config, facts, 1, hardware.kind).optimizer)}


def row_line(row: dict[str, Any]) -> str:
    """One markdown row of the table :func:`main` prints."""
    label = Config.from_dict(row["config"]).label()
    states = [f"{row[k] / 2**20:.2f}" if k in row else "-" for k in ("optimizer_predicted", "optimizer_measured")]
    return (f"| {row['model']} | {label} | {row['predicted'] / 2**20:.1f} | {row['measured'] / 2**20:.1f} | "
            f"{row['error']:+.1%} | {states[0]} | {states[1]} |")


def loadable(entry: str) -> str:
    """``entry`` as a probe's process can load it: an ``hf:`` local folder made absolute."""
    return HfEntry.parse(entry).absolute().to_entry() if is_hf_entry(entry) else entry


def held_out(entry: str) -> bool:
    """Whether no constant of the cost model was set on ``entry``'s model: a hand-written one under
    :data:`HELD_OUT_DIR`; a shipped ``hf:`` config where its twin is (or it has none)."""
    if not is_hf_entry(entry):
        return entry.startswith(HELD_OUT_DIR)
    folder = Path(HfEntry.parse(entry).source)
    twin = HF_TWINS.get(folder.name, ("", ""))[1] if folder.parent.name == Path(HF_CONFIGS).name else ""
    return twin is None or twin.startswith(HELD_OUT_DIR)


def model_facts(entry: str, configs: list[Config]) -> tuple[Any, list[Config], Any]:
    """The workload of ``entry``, the configs it can run, and its traced facts with its kernel footprints."""
    workload = load_workload(entry)
    configs = runnable(configs, workload)
    return workload, configs, with_kernel_footprints(trace_for(workload, configs), entry, configs)


def measure(entry: str, configs: list[Config], timeout_s: float) -> list[dict[str, Any]]:
    """Probe every config of one model; print and return its rows (errored probes print and are left out)."""
    hardware = get_hardware("cpu")
    entry = loadable(entry)
    workload, configs, facts = model_facts(entry, configs)
    prepare_ops(configs, hardware)  # an op built inside a probe would be measured with it
    rows = []
    for config in configs:
        started = time.time()
        measured = run_probe(probe_spec(entry, config, hardware, 1, steps=1, warmup_steps=1, facts=facts),
                             timeout_s=timeout_s)
        if measured.status != "ok":
            print(f"| {workload.name} | {config.label()} | - | - | {measured.status}: {measured.message[:120]} |", flush=True)
            continue
        row = {"model": workload.name, "held_out": held_out(entry), "config": config.to_dict(),
               "measured": measured.peak_bytes, "optimizer_measured": measured.optimizer_state_bytes,
               "initialize_measured": measured.per_rank_initialize_bytes[0],
               "probe_s": time.time() - started} | priced(config, facts, hardware, measured.peak_bytes)
        rows.append(row)
        print(row_line(row), flush=True)
    return rows


def twin_entries(root: Path) -> list[tuple[str, str | None]]:
    """Each :data:`HF_TWINS` family as (its ``hf:`` entry, its twin's entry or None), paths under ``root``."""
    out = []
    for family, (options, twin) in HF_TWINS.items():
        entry = f"hf:{root / HF_CONFIGS / family}" + (f"?{options}" if options else "")
        out.append((entry, None if twin is None else str(root / twin)))
    return out


def relative(entry: str) -> str:
    """``entry`` with this checkout's root left out (the results JSON names entries as the docs do)."""
    return entry.replace(str(ROOT) + "/", "")


def with_twin(rows: list[dict[str, Any]], twin: str) -> list[dict[str, Any]]:
    """``rows`` (one model's) with the twin's prediction of each row's config beside it: ``twin_predicted``, its
    error against the same measurement, and ``hf_vs_twin`` = (predicted - twin_predicted) / twin_predicted."""
    hardware = get_hardware("cpu")
    twin_workload, _, twin_facts = model_facts(twin, [Config.from_dict(row["config"]) for row in rows])
    out = []
    for row in rows:
        twin_priced = priced(Config.from_dict(row["config"]), twin_facts, hardware, row["measured"])
        out.append(row | {"twin": twin_workload.name, "twin_entry": relative(twin),
                          "twin_predicted": twin_priced["predicted"], "twin_error": twin_priced["error"],
                          "hf_vs_twin": (row["predicted"] - twin_priced["predicted"]) / twin_priced["predicted"]})
        print(f"| twin {out[-1]['twin']} | {Config.from_dict(row['config']).label()} | "
              f"{out[-1]['twin_predicted'] / 2**20:.1f} | - | {out[-1]['twin_error']:+.1%} | "
              f"hf vs twin {out[-1]['hf_vs_twin']:+.2%} |", flush=True)
    return out


def measure_twins(entry: str, twin: str | None, configs: list[Config], timeout_s: float) -> list[dict[str, Any]]:
    """:func:`measure` of the ``hf:`` entry, each row with its entry and the twin's prediction (:func:`with_twin`)."""
    rows = [row | {"entry": relative(entry)} for row in measure(entry, configs, timeout_s)]
    return with_twin(rows, twin) if twin is not None and rows else rows


def reprice(rows: list[dict[str, Any]], entries: list[str]) -> list[dict[str, Any]]:
    """``rows`` with their predictions made again by today's cost model (measurements kept)."""
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    hardware = get_hardware("cpu")
    entries = [loadable(entry) for entry in entries]
    by_name = {load_workload(entry).name: entry for entry in entries}
    out = []
    for name in dict.fromkeys(row["model"] for row in rows):
        if name not in by_name:
            raise SystemExit(f"memory_accuracy: no entry among --models makes the model {name!r}")
        mine = [row for row in rows if row["model"] == name]
        configs = [Config.from_dict(row["config"]) for row in mine]
        facts = with_kernel_footprints(trace_for(load_workload(by_name[name]), configs), by_name[name], configs)
        again = []
        for row, config in zip(mine, configs, strict=True):
            again.append(row | priced(config, facts, hardware, row["measured"]) | {"priced_on": commit})
            print(row_line(again[-1]), flush=True)
        twin = mine[0].get("twin_entry")
        out.extend(with_twin(again, str(ROOT / twin)) if twin else again)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--techniques", action="store_true", help="only the TECHNIQUE_GRID rows")
    parser.add_argument("--no-techniques", action="store_true", help="leave out the TECHNIQUE_GRID rows")
    parser.add_argument("--hf-twins", action="store_true",
                        help="TWIN_GRID on every shipped hf: config, beside its hand-written twin's prediction")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one probe may take")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--reprice", default=None, metavar="FILE",
                        help="price FILE's rows again (measurements kept) and write them back (or to --json)")
    args = parser.parse_args()
    if args.techniques and args.no_techniques:
        parser.error("--techniques and --no-techniques exclude each other")
    configs = configs_for(args.quick, args.techniques, not args.no_techniques)
    print("| model | config | predicted MiB | measured MiB | error | optimizer states predicted MiB | measured MiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    kept: dict[str, Any] = {}
    if args.reprice:
        try:
            kept = json.loads(Path(args.reprice).read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"memory_accuracy: cannot read {args.reprice}: {exc}") from exc
        entries = [entry for entry, _ in twin_entries(ROOT)] if args.hf_twins else args.models
        rows = reprice(kept["rows"], entries)
        args.json_path = args.json_path or args.reprice
    elif args.hf_twins:
        twin_configs = [fully_fixed(*row) for row in TWIN_GRID]
        rows = [row for entry, twin in twin_entries(ROOT) for row in measure_twins(entry, twin, twin_configs,
                                                                                     args.timeout)]
    else:
        rows = [row for entry in args.models for row in measure(entry, configs, args.timeout)]
    summary = summarize(rows) if rows else []
    print("\n| group | configs | median \\|error\\| | worst \\|error\\| | worst under-prediction |")
    print("|---|---:|---:|---:|---:|")
    for group in summary:
        print(f"| {group['group']} | {group['n']} | {group['median_abs']:.1%} | {group['worst_abs']:.1%} | "
              f"{group['worst_under']:+.1%} |")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(kept | {"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
