"""The oracle both search benchmarks score against (benchmarks/search/search_regret.py and
benchmarks/peers/compare_search.py): the models, the space's scenarios, every candidate probed once (cached under
``benchmarks/results/oracle*/``) and the tight budgets drawn from the oracle's measured peaks."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

from autofit.core.config import Config
from autofit.core.space import enumerate_candidates, load_space, space_from_dict
from autofit.ds.emit import write_json_atomic
from autofit.machine.software import detect_software
from autofit.probe.result import ProbeResult
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec
from autofit.workload.entry import load_workload

MODELS = {
    "gpt": "examples/gpt.py:workload",
    "vit": "benchmarks/models/vit.py:workload",
    "cnn": "benchmarks/models/cnn.py:workload",
    "gqa_llama": "benchmarks/models/gqa_llama.py:workload",
    "t5": "benchmarks/models/t5_encdec.py:workload",
    "mlp": "examples/mlp.py:workload",
}
#: search_spaces/cpu.yaml restricted with --set: fp32, ZeRO 0, sdpa; micro-batch x checkpointing x all five optimizers (45)
FIXED = {"precision": "fp32", "zero_stage": 0, "attention": "sdpa"}
OPTIMIZERS = ("adamw", "adamw8bit", "lion", "adafactor", "sgd")
MARGIN = 0.10
QUANTILES = (0.25, 0.5, 0.75)
#: the default-space scenario: only the attention kernel fixed (a CPU runs sdpa and eager alike; one kernel
#: halves the oracle), every precision x optimizer x ZeRO stage of cpu.yaml; two tight budgets
DEFAULT_FIXED = {"attention": "sdpa"}
DEFAULT_QUANTILES = (0.25, 0.5)


@dataclass(frozen=True)
class Scenario:
    """What the oracle and the search range over: cpu.yaml with ``fixed`` keys and ``optimizers``; budgets at
    ``quantiles`` of the oracle's measured peaks."""

    name: str
    fixed: dict
    optimizers: tuple[str, ...]
    quantiles: tuple[float, ...]


SCENARIOS = {
    "fp32": Scenario("fp32", FIXED, OPTIMIZERS, QUANTILES),
    "default": Scenario("default", DEFAULT_FIXED, tuple(load_space("cpu").values["optimizer"]), DEFAULT_QUANTILES),
}
FP32 = SCENARIOS["fp32"]
#: smaller than cpu.yaml's 16 to keep the oracle affordable: micro-batches 1, 2, 4
GLOBAL_BATCH = 4
#: timed steps per probe, the search's default
STEPS = 5


def regret_space(scenario: Scenario = FP32):
    """search_spaces/cpu.yaml with its optimizers restricted to the scenario's."""
    data = load_space("cpu").to_dict() | {"optimizer": list(scenario.optimizers)}
    return space_from_dict(data, name=f"cpu-regret-{scenario.name}")


def candidate_configs(entry: str, hardware, scenario: Scenario = FP32) -> list[Config]:
    space = regret_space(scenario)
    workload = load_workload(entry)
    configs = enumerate_candidates(
        space, software=detect_software(),
        hardware=hardware,
        world_size=1,
        global_batch=GLOBAL_BATCH,
        fixed=scenario.fixed,
        searches_attention=workload.searches_attention,
    ).candidates
    return configs


def probe_config(entry: str, config: Config, hardware) -> object:
    return run_probe(probe_spec(entry, config, hardware, 1, steps=STEPS), timeout_s=300)


def config_key(config: Config) -> str:
    return json.dumps(config.to_dict(), sort_keys=True)


def probe_from_dict(data: dict) -> ProbeResult:
    """A ProbeResult back from its ``to_json``."""
    known = {f.name for f in fields(ProbeResult)}
    # the oracle's own prediction is not the search's (the driver prices each probe itself): left out
    return ProbeResult(**({k: v for k, v in data.items() if k in known}
                          | {"config": Config.from_dict(data["config"]), "predicted": None}))


def cached_points(cache: Path, name: str, wanted: set[str]) -> tuple[dict[str, ProbeResult], float]:
    """The probes of ``DIR/<name>.json`` and of its shards ``DIR/<name>.shard*.json``, and their probe seconds."""
    done: dict[str, ProbeResult] = {}
    wall_s = 0.0
    for path in [cache / f"{name}.json", *sorted(cache.glob(f"{name}.shard*.json"))]:
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        try:
            points = {config_key(p.config): p for p in map(probe_from_dict, data["points"]) if config_key(p.config) in wanted}
            seconds = float(data["wall_s"])
        except (KeyError, TypeError):  # an older cache that kept less of each probe: probe again
            continue
        new = {k: p for k, p in points.items() if k not in done}
        done |= new
        wall_s += seconds * len(new) / max(1, len(points))
    return done, wall_s


def run_oracle(name: str, entry: str, configs: list[Config], host, cache: Path | None,
            shard: tuple[int, int] = (0, 1)) -> tuple[list[ProbeResult], float]:
    """Every config probed once, in ``configs``' order; with ``cache``, the probes already there (shards
    included) are kept and the cache is rewritten after each new probe (an interrupted oracle resumes where it
    stopped). ``shard = (i, n)`` probes only every n-th config from the i-th, into ``DIR/<name>.shard<i>of<n>.json``
    (n one-thread shards side by side; a later run without ``--shard`` merges them into ``DIR/<name>.json``)."""
    index, count = shard
    path = None
    if cache:
        path = cache / (f"{name}.json" if count == 1 else f"{name}.shard{index}of{count}.json")
    wanted = {config_key(c) for c in configs}
    done, wall_s = cached_points(cache, name, wanted) if cache else ({}, 0.0)
    mine = [c for i, c in enumerate(configs) if i % count == index]
    for i, config in enumerate(configs):
        if i % count != index or config_key(config) in done:
            continue
        t0 = time.monotonic()
        r = probe_config(entry, config, host)
        wall_s += time.monotonic() - t0
        done[config_key(config)] = r
        print(
            f"  oracle {name} {i + 1}/{len(configs)} {config.label()}: {r.status} "
            f"{r.samples_per_s:.3g}/s {r.peak_bytes / 2**20:.1f} MiB",
            file=sys.stderr,
            flush=True,
        )
        if path:  # atomically: a run stopped mid-write keeps the cache it had
            kept = configs if count == 1 else mine
            points = [done[config_key(c)].to_json() for c in kept if config_key(c) in done]
            write_json_atomic(path, {"wall_s": wall_s, "points": points})
    if path and count == 1 and any(cache.glob(f"{name}.shard*.json")) and len(done) == len(wanted):  # merge the shards
        write_json_atomic(path, {"wall_s": wall_s, "points": [done[config_key(c)].to_json() for c in configs]})
    if count > 1:
        return [done[config_key(c)] for c in mine if config_key(c) in done], wall_s
    return [done[config_key(c)] for c in configs], wall_s


def usable_budgets(peaks: list[int], quantiles: tuple[float, ...] = QUANTILES) -> list[int]:
    """For each quantile, a usable budget midway between the quantile's peak and the next peak 1 % above it."""
    peaks = sorted(peaks)
    out = []
    for q in quantiles:
        at = peaks[min(len(peaks) - 1, int(q * len(peaks)))]
        above = [p for p in peaks if p > 1.01 * at]
        out.append(int((at + above[0]) / 2) if above else int(1.01 * at))
    return out


def budgets(oracle: list[ProbeResult], quantiles: tuple[float, ...] = QUANTILES) -> list[tuple[int, list[ProbeResult]]]:
    """Each budget of :func:`usable_budgets` as device bytes, with the oracle probes that fit its usable part."""
    out = []
    for usable in usable_budgets([r.peak_bytes for r in oracle if r.status == "ok"], quantiles):
        budget = int(usable / (1 - MARGIN)) + 1
        out.append((budget, [r for r in oracle if r.status == "ok" and r.peak_bytes <= (1 - MARGIN) * budget]))
    return out


