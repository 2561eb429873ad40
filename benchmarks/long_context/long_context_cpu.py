"""Long context on the CPU: the cost model against real DeepSpeed steps (issue 38; the prior's part is long_context.py).

    DS_ACCELERATOR=cpu python -m benchmarks.long_context.long_context_cpu [--budget 384MiB] [--quick]

Two questions, each probe a real DeepSpeed run (``autofit.probe.run.run_probe``, gloo, fp32, AdamW, sdpa):

* **The longest sequence under a memory budget**, for two decoder families (a GQA Llama and a Qwen2 with as many
  kv heads as heads; configs in benchmarks/models/long_context/, the ``llama_gqa`` shapes with a longer
  ``max_position_embeddings``): predicted by ``autofit estimate --seq-len max`` with the config fixed, found by
  bisecting probes of that config under the budget (a probe passing the budget ends ``oom`` by the RSS watchdog).
  Goal: within 10 %.
* **Peak memory, predicted vs measured**: the GQA Llama at a fixed length with each technique off and on, on one
  rank, on two ranks without SP (data-parallel 2: what two ZeRO-3 ranks cost apart from SP), and under Ulysses SP = 2
  on two ranks (world 2, data-parallel 1). ZeRO-3 throughout (SP is ZeRO-3 only,
  docs/develop/long-context.md, Finding 1). Goal: within 3 %. ``offload_activations`` is not here: on the CPU
  accelerator DeepSpeed's checkpoint offload moves nothing (host and device are one), and the rules refuse it.

Writes benchmarks/results/long_context_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
ROOT = HERE.parent

from autofit.core.config import Config  # noqa: E402
from autofit.core.units import parse_bytes  # noqa: E402
from autofit.cost_model.facts import ModelFacts  # noqa: E402
from autofit.planning.estimate import EstimateResult  # noqa: E402

MODELS = {"llama-gqa": HERE / "models" / "long_context" / "llama_gqa", "qwen2": HERE / "models" / "long_context" / "qwen2"}
RESULTS = HERE / "results" / "long_context_cpu.json"
#: every key fixed: one candidate, the one the probes run
BASE = {"micro_batch_size": 1, "precision": "fp32", "optimizer": "adamw", "zero_stage": 3, "attention": "sdpa",
        "checkpoint_ratio": 0.0, "checkpoint_granularity": "block", "offload_optimizer": "none", "offload_params": "none",
        "compile": "off", "overlap_comm": False, "contiguous_gradients": True, "bucket_scale": 1, "sequence_parallel": 1,
        "tiled_mlp": False, "tiled_loss": False, "offload_activations": "none"}
PEAK_CASES = (("sp1", {}, 1), ("sp1 tiled_mlp", {"tiled_mlp": True}, 1), ("sp1 tiled_loss", {"tiled_loss": True}, 1),
              ("world2 sp1 (dp2)", {}, 2), ("sp2", {"sequence_parallel": 2}, 2),
              ("sp2 tiled_mlp", {"sequence_parallel": 2, "tiled_mlp": True}, 2),
              ("sp2 tiled_loss", {"sequence_parallel": 2, "tiled_loss": True}, 2),
              ("sp2 tiled_mlp tiled_loss", {"sequence_parallel": 2, "tiled_mlp": True, "tiled_loss": True}, 2))


def _sets(keys: dict) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in (BASE | keys).items()]


def predicted_longest(folder: Path, budget: str) -> dict:
    """``autofit estimate --seq-len max`` for the fixed config (its answer and the config it names)."""
    command = [sys.executable, "-c", "from autofit.cli import main; main()", "estimate", f"hf:{folder}", "--seq-len", "max",
               "--hardware", "cpu",
               "--memory", budget, "--json"]
    for value in _sets({}):
        command += ["--set", value]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    if done.returncode:
        raise SystemExit(f"autofit estimate --seq-len max failed: {done.stderr[-2000:]}")
    answer = json.loads(done.stdout)
    return {"seq_len": int(answer["seq_len"]), "label": answer.get("label"), "ladder": answer.get("ladder")}


def traced_facts(folder: Path, seq_len: int, keys: dict, world: int = 1) -> tuple[ModelFacts, EstimateResult]:
    """The model's traced facts, as ``autofit estimate`` prices the fixed config with them (and the estimate)."""
    import autofit

    result = autofit.estimate(f"hf:{folder}", hardware="cpu", gpus=world, seq_len=seq_len, set=BASE | keys)
    return result.facts, result


def fits(folder: Path, seq_len: int, budget_bytes: int, keys: dict, facts: ModelFacts,
         world: int = 1) -> tuple[bool, dict]:
    """One probe of the fixed config at ``seq_len`` under the budget: whether it ran within it, and what it measured.

    ``facts``: the traced model the estimate priced. The probe's DeepSpeed JSON takes its ZeRO buckets from them
    (the hidden size, :mod:`autofit.ds.buckets`), as the candidate's JSON does; without them the probe would run
    autofit's buckets for an unknown model (50 M-element reduce and prefetch buckets, persistence 1e5), not the
    config the estimate priced: on ZeRO-3 the reduce bucket alone then holds every gradient (``torch.empty(
    reduce_bucket_size)`` in stage3.py, its pages written on the CPU), 18.6 MiB a rank on the GQA Llama here."""
    from autofit.machine.device import get_hardware
    from autofit.probe.run import run_probe
    from autofit.probe.spec import probe_spec

    config = Config(**(BASE | keys))
    hardware = get_hardware("cpu", budget_bytes)
    t0 = time.monotonic()
    spec = probe_spec(f"hf:{folder}?seq_len={seq_len}", config, hardware, world_size=world, steps=1, warmup_steps=1,
                      facts=facts)
    result = run_probe(spec, timeout_s=600)
    zero = spec.deepspeed["zero_optimization"]
    row = {"seq_len": seq_len, "status": result.status, "peak_bytes": result.peak_bytes, "wall_s": time.monotonic() - t0,
           "message": result.message, "buckets": {k: zero[k] for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                                                                       "stage3_param_persistence_threshold")}}
    print(f"  probe seq {seq_len}: {result.status} peak {result.peak_bytes / 2**20:.1f} MiB", flush=True)
    if result.status not in ("ok", "oom"):
        raise SystemExit(f"probe at {seq_len} ended {result.status}: {result.message}")
    # the RSS watchdog samples, so a short spike past the budget can end ``ok``: the run fits when its peak (VmHWM,
    # read by the rank itself) is within the budget too
    return result.status == "ok" and result.peak_bytes <= budget_bytes, row


def bisect_longest(folder: Path, start: int, budget_bytes: int, unit: int = 64, tolerance: float = 0.04) -> dict:
    """The longest length whose probe fits, from the prediction outwards: bracket it by 15 % steps, then halve the
    bracket until it is within ``tolerance``."""
    rounded = max(unit, start // unit * unit)
    probes: list[dict] = []
    facts, _ = traced_facts(folder, rounded, {})  # the buckets' hidden size does not change with the length

    def ok(seq_len: int) -> bool:
        fit, row = fits(folder, seq_len, budget_bytes, {}, facts)
        probes.append(row)
        return fit

    lo, hi = (rounded, None) if ok(rounded) else (None, rounded)
    while lo is None or hi is None:
        step = (lo or hi) * (1.15 if hi is None else 1 / 1.15)
        probe = max(unit, int(step) // unit * unit)
        if ok(probe):
            lo = probe
        else:
            hi = probe
    while hi - lo > unit and hi / lo > 1 + tolerance:
        middle = (lo + hi) // 2 // unit * unit
        if ok(middle):
            lo = middle
        else:
            hi = middle
    return {"found": lo, "first_failing": hi, "probes": probes}


def predicted_peak(folder: Path, seq_len: int, keys: dict, world: int) -> tuple[int, ModelFacts]:
    """The estimate's peak for the fixed config, and the facts it priced it with."""
    facts, result = traced_facts(folder, seq_len, keys, world)
    if not result.candidates:
        raise SystemExit(f"estimate refused {keys}: {result.rejected}")
    return int(result.candidates[0].prediction.peak_bytes), facts


def peaks(folder: Path, seq_len: int, cases: tuple) -> list[dict]:
    rows = []
    for name, keys, world in cases:
        predicted, facts = predicted_peak(folder, seq_len, keys, world)
        _, measured = fits(folder, seq_len, 2**40, keys, facts, world)
        error = predicted / measured["peak_bytes"] - 1 if measured["peak_bytes"] else None
        rows.append({"case": name, "world_size": world, "seq_len": seq_len, "predicted_bytes": predicted,
                     "measured_bytes": measured["peak_bytes"], "relative_error": error, "step_s": measured["wall_s"],
                     "buckets": measured["buckets"]})
        print(f"{name}: predicted {predicted / 2**20:.1f} MiB, measured {measured['peak_bytes'] / 2**20:.1f} MiB "
              f"({error:+.1%})" if error is not None else f"{name}: no measurement", flush=True)
    return rows


def repredicted(longest: dict, budget: str) -> dict:
    """The stored bisections with the cost model's longest sequence predicted again."""
    for name, row in longest.items():
        row["predicted"] = predicted_longest(MODELS[name], budget)
        row["relative_error"] = row["predicted"]["seq_len"] / row["found"] - 1
        print(f"{name}: predicted {row['predicted']['seq_len']}, found {row['found']} ({row['relative_error']:+.1%})",
              flush=True)
    return longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="384MiB", help="The memory budget of the longest-sequence question.")
    parser.add_argument("--peak-seq-len", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="The peaks of SP = 2 with both tiles only, no bisection.")
    parser.add_argument("--peaks-only", action="store_true",
                        help="Every peak case probed again, the longest sequences predicted again; the bisections' "
                             "probes kept from the results file.")
    args = parser.parse_args()
    t0 = time.monotonic()
    out: dict = {"budget": args.budget, "longest": {}, "peaks": []}
    if args.peaks_only:
        out["longest"] = repredicted(json.loads(RESULTS.read_text())["longest"], args.budget)
    elif not args.quick:
        for name, folder in MODELS.items():
            predicted = predicted_longest(folder, args.budget)
            print(f"{name}: predicted longest {predicted['seq_len']}", flush=True)
            found = bisect_longest(folder, predicted["seq_len"], parse_bytes(args.budget))
            error = predicted["seq_len"] / found["found"] - 1
            out["longest"][name] = {"predicted": predicted, **found, "relative_error": error, "goal": 0.10}
            print(f"{name}: predicted {predicted['seq_len']}, found {found['found']} ({error:+.1%})", flush=True)
    cases = PEAK_CASES[-1:] if args.quick else PEAK_CASES
    out["peaks"] = peaks(MODELS["llama-gqa"], args.peak_seq_len, cases)
    out["peak_goal"] = 0.03
    out["wall_s"] = time.monotonic() - t0
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS} in {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
