"""autofit's model states per GPU against DeepSpeed's own estimators, LLaMA-2 7B / 13B / 70B on 8 nodes x 8 GPUs.

    python -m benchmarks.peers.deepspeed_estimators

bf16 + AdamW; autofit's ``model_states(...).resident`` and ``cost_model.host.host_peak_bytes`` against
DeepSpeed's ``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs(zero_init=True)``
(``gpu_mem``; ``cpu_mem`` per node), each model built on the meta device (``autofit.trace.parameter_facts``).
For ZeRO-3 without offload the difference is split into the terms each side counts: DeepSpeed's
``18 B x Psi / N + 4 B x largest layer`` (stage3.py) against autofit's per-parameter states and the buffers a
rank holds whatever N is (the gathered window of ``stage3_max_reuse_distance`` and the prefetch bucket, the
running module made whole, the reduce bucket). Writes ``deepspeed_estimators.{json,md,png}``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autofit.core.config import Config
from autofit.cost_model.host import host_peak_bytes
from autofit.cost_model.memory import WORKING_BYTES
from autofit.cost_model.states import buckets_of, model_states, stage3_live_elements
from autofit.machine.device import get_hardware
from autofit.trace import parameter_facts
from autofit.workload.entry import load_workload
from benchmarks import common as cc

GPUS, NODES = 8, 8
MODELS = ("llama2_7b", "llama2_13b", "llama2_70b")
GIB = 2**30


def deepspeed_bytes(stage: int, facts: Any, offload: bool) -> tuple[int, int]:
    """DeepSpeed's ``(gpu_mem, cpu_mem)`` for ``stage``, offloading the optimizer (and, ZeRO-3, the parameters)."""
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    if stage == 2:
        cpu, gpu = stage_1_and_2.estimate_zero2_model_states_mem_needs(facts.n_params, GPUS, NODES, cpu_offload=offload)
        return gpu, cpu
    cpu, gpu, _ = stage3.estimate_zero3_model_states_mem_needs(
        facts.n_params, facts.largest_module_params, GPUS, NODES, cpu_offload=offload, cpu_offload_params=offload,
        zero_init=True)
    return gpu, cpu


def zero3_terms(facts: Any, config: Config) -> dict[str, float]:
    """ZeRO-3 without offload, each side's terms in GiB: what scales with Psi / N and what does not."""
    states = model_states(config, facts, GPUS * NODES, "cuda")
    w = WORKING_BYTES[config.precision]
    gathered_window = w * (stage3_live_elements(float("inf"), 0.0, buckets_of(config, facts)))
    return {
        "autofit_per_parameter": (states.params + states.master + states.optimizer + w * facts.n_trainable_params
                                  / (GPUS * NODES)) / GIB,
        "autofit_window": gathered_window / GIB,
        "autofit_running_module": w * facts.largest_module_params / GIB,
        "autofit_reduce_bucket": (states.grads_resident - w * facts.n_trainable_params / (GPUS * NODES)) / GIB,
        "deepspeed_per_parameter": 18 * facts.n_params / (GPUS * NODES) / GIB,
        "deepspeed_largest_layer": 4 * facts.largest_module_params / GIB,
    }


def rows() -> list[dict[str, Any]]:
    hardware = dataclasses.replace(get_hardware("h100-80gb"), devices_per_node=GPUS)
    out = []
    for name in MODELS:
        facts = parameter_facts(load_workload(f"{cc.ROOT / 'examples/llama2.py'}:{name}"))
        for stage, offload in ((2, False), (2, True), (3, False), (3, True)):
            device = "cpu" if offload else "none"
            config = Config(precision="bf16", optimizer="adamw", zero_stage=stage, offload_optimizer=device,
                            offload_params=device if stage == 3 else "none")
            ours = model_states(config, facts, GPUS * NODES, "cuda").resident
            gpu, cpu = deepspeed_bytes(stage, facts, offload)
            row = {"model": name, "n_params": facts.n_params, "zero_stage": stage, "offload": offload,
                   "autofit_gib": ours / GIB, "deepspeed_gib": gpu / GIB, "diff": ours / gpu - 1,
                   "autofit_host_gib": host_peak_bytes(config, facts, hardware, GPUS * NODES, int(ours)) / GIB,
                   "deepspeed_host_gib": cpu / GIB}
            if stage == 3 and not offload:
                row["terms"] = zero3_terms(facts, config)
            out.append(row)
    return out


def markdown(data: list[dict[str, Any]]) -> str:
    table = cc.markdown_table(
        ["model", "ZeRO", "offload", "autofit GiB/GPU", "DeepSpeed GiB/GPU", "diff", "autofit host GiB/node",
         "DeepSpeed host GiB/node"],
        [[f"{r['model']} ({r['n_params'] / 1e9:.2f} B)", r["zero_stage"],
          ("optimizer+params" if r["zero_stage"] == 3 else "optimizer") if r["offload"] else "none",
          f"{r['autofit_gib']:.2f}", f"{r['deepspeed_gib']:.2f}", cc.pct(r["diff"]), f"{r['autofit_host_gib']:.0f}",
          f"{r['deepspeed_host_gib']:.0f}"] for r in data], right=1)
    terms = [r for r in data if "terms" in r]
    split = cc.markdown_table(
        ["model", "autofit per-parameter", "window (reuse + prefetch)", "running module", "reduce bucket",
         "DeepSpeed 18 B x Psi/N", "DeepSpeed 4 B x largest layer"],
        [[r["model"], *(f"{r['terms'][k]:.2f}" for k in ("autofit_per_parameter", "autofit_window",
                                                          "autofit_running_module", "autofit_reduce_bucket",
                                                          "deepspeed_per_parameter", "deepspeed_largest_layer"))]
         for r in terms], right=1)
    return f"{table}\n\nZeRO-3 without offload, GiB per GPU by term ({GPUS * NODES} GPUs):\n\n{split}\n"


def chart(data: list[dict[str, Any]]) -> Any:
    fig, axes = cc.new_figure(1)
    ax = axes[0][0]
    labels = [f"{r['model'][7:]} z{r['zero_stage']}{' off' if r['offload'] else ''}" for r in data]
    xs = range(len(data))
    ax.bar([x - 0.2 for x in xs], [r["autofit_gib"] for r in data], width=0.4, label="autofit")
    ax.bar([x + 0.2 for x in xs], [r["deepspeed_gib"] for r in data], width=0.4, label="DeepSpeed estimator")
    ax.set_xticks(list(xs), labels, rotation=60, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("model states GiB per GPU")
    ax.legend()
    return fig


def main() -> None:
    data = rows()
    cc.write_results("deepspeed_estimators", data, markdown(data), chart(data))


if __name__ == "__main__":
    main()
