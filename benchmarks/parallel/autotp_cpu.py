"""DeepSpeed AutoTP training on CPU ranks (gloo over loopback): what runs, what each rank holds, and whether the loss
is the unsharded run's. The groundwork for tensor parallelism in autofit's space (issue 50).

    DS_ACCELERATOR=cpu python -m benchmarks.parallel.autotp_cpu [--stages 0 1 2 3] [--steps 4] [--dp 1]
        [--out benchmarks/results/autotp_cpu.json]
    DS_ACCELERATOR=cpu python -m benchmarks.parallel.autotp_cpu --trainer

A tiny Llama-shaped ``transformers`` model (hidden 256, intermediate 512, 4 layers, 8 heads, 4 KV heads, vocabulary
1024, untied head, fp32, SDPA) trains ``--steps`` steps at sequence 128 through ``deepspeed.initialize`` with
``"tensor_parallel": {"autotp_size": 2}`` on ``2 x dp`` ranks, at each ZeRO stage of ``--stages``, with and without
activation checkpointing (every layer, ``autofit.ds.apply.apply_checkpointing``: ``torch.utils.checkpoint``,
non-reentrant), beside the same run without tensor parallelism on ``dp`` ranks (the reference: the same seed, the
same weights, the same global batch of 4 samples a data-parallel rank).

Each rank runs in a process of its own, started as autofit's probe starts one (``autofit.probe.launch.training_env``:
``MALLOC_MMAP_THRESHOLD_`` so RSS tracks live tensors), and is metered as the probe meters it
(``autofit.probe.rank.meter.Meter``: VmHWM less the RSS after the imports). Per rank: the parameter elements it
holds (the ZeRO-3 partition where there is one), split into AutoTP's sharded layers and the replicated rest; the
peak after the model is built, after ``deepspeed.initialize`` and after the steps; the steps' own peak above the
RSS held after ``initialize``; the loss of every step; the collectives the tensor-parallel layers issue in one
step (``deepspeed.comm.all_reduce`` / ``all_gather_into_tensor``: calls and bytes, by group). A combination that
fails keeps the exception's first line and the DeepSpeed source line that raised it. The JSON leaves
``train_batch_size`` out (:func:`ds_config` says why); three more rows write it, as the HF Trainer does and as the
samples a step takes, to keep DeepSpeed's refusals. ``--trainer`` runs the same model and AutoTP through the HF
``Trainer`` (ZeRO 3 with ``train_batch_size`` ``"auto"`` and absent, ZeRO 0 with ``"auto"``) into the same file.
Results: docs/results/autotp_cpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "autotp_cpu.json"
MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 1024, "max_position_embeddings": 256, "tie_word_embeddings": False}
SEQ = 128
#: samples a data-parallel rank takes a step (the micro-batch; no accumulation)
MICRO = 4
SEED = 1234
LR = 1e-3
#: seconds one combination's ranks get before they are stopped
RUN_TIMEOUT_S = 300


def ds_config(tp: int, stage: int, dp: int, batch_over: str = "omit", offload: str = "none") -> dict[str, Any]:
    """The JSON ``deepspeed.initialize`` takes: fp32, torch's AdamW, ``tensor_parallel.autotp_size`` where tp > 1.

    ``train_batch_size`` (``batch_over``): ``"omit"`` leaves it out (micro-batch and accumulation only), the one
    way every ZeRO stage runs under TP. DeepSpeed checks it twice: ``deepspeed.initialize`` builds a
    ``DeepSpeedConfig`` with no ``mpu`` (deepspeed/__init__.py:554), whose world is ``dist.get_world_size()``
    (deepspeed/runtime/config.py:467-471), TP ranks counted as data-parallel; ZeRO-3 builds another inside
    ``zero.Init`` (deepspeed/runtime/zero/parameter_offload.py:270, partition_parameters.py:1077) with the engine's
    TP groups as ``mpu``, whose world is the data-parallel one (config.py:463). Both assert
    ``train_batch_size == micro x GA x world`` (config.py:602). ``"world"`` (micro x world, what the HF Trainer and
    Accelerate write) passes the first and fails the second; ``"dp"`` (micro x dp, the samples a step takes) fails
    the first. Leaving it out lets each derive its own (config.py:640)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if batch_over != "omit":
        config["train_batch_size"] = MICRO * (tp * dp if batch_over == "world" else dp)
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    if offload in ("optimizer", "both"):  # torch's AdamW on the host (the CPU has no DeepSpeedCPUAdam to prefer)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    if offload in ("params", "both"):
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return config


# --------------------------------------------------------------------------------------------------------------
# one rank


def _deepspeed_frames(tb: Any) -> list[str]:
    """``deepspeed/<path>:<line>`` of the frames of ``tb`` inside DeepSpeed's package, outermost first."""
    marker = "/site-packages/deepspeed/"
    return [f"deepspeed/{frame.filename.split(marker, 1)[1]}:{frame.lineno}"
            for frame in traceback.extract_tb(tb) if marker in frame.filename]


def _split_params(model: Any) -> dict[str, int]:
    """Parameter elements this rank holds, by AutoTP's treatment: the tensor-parallel layers' (sharded) and the
    rest (replicated: embeddings, norms, any layer AutoTP left whole). ZeRO-3: the rank's partition."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    sharded_ids = {id(p) for m in model.modules() if isinstance(m, TensorParallel_Layer) for p in m.parameters()}
    out = {"sharded": 0, "replicated": 0}
    for p in model.parameters():
        held = int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else int(p.numel())
        out["sharded" if id(p) in sharded_ids else "replicated"] += held
    out["total"] = out["sharded"] + out["replicated"]
    return out


def _layer_kinds(model: Any) -> dict[str, str]:
    """Module name -> the AutoTP layer class that replaced it (first layer and the head only)."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    return {name: type(m).__name__ for name, m in model.named_modules()
            if isinstance(m, TensorParallel_Layer) and (".layers." not in f".{name}" or ".layers.0." in f".{name}")}


def _optimizer_state_elements(engine: Any) -> int:
    """Elements of the tensors the innermost optimizer keeps (Adam's two moments of this rank's parameters)."""
    optimizer = engine.optimizer
    while hasattr(optimizer, "optimizer") and optimizer.optimizer is not optimizer:
        optimizer = optimizer.optimizer
    return sum(int(v.numel()) for state in optimizer.state.values() for k, v in state.items()
               if k != "step" and hasattr(v, "numel"))


class _CommCounter:
    """Counts ``deepspeed.comm.all_reduce`` and ``all_gather_into_tensor`` calls and bytes (an all-gather's: the
    shard this rank sends) while ``on``, by group
    (``tp`` the tensor-parallel group, ``dp`` the data-parallel one, ``world`` or ``other``). AutoTP's layers call
    them through the module (``from deepspeed import comm as dist``), so the patched names are the ones called."""

    def __init__(self, groups: dict[str, Any]) -> None:
        import deepspeed.comm as dist

        self.dist, self.groups, self.on = dist, groups, False
        self.counts: dict[str, dict[str, int]] = {}
        for name in ("all_reduce", "all_gather_into_tensor"):
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _label(self, group: Any) -> str:
        if group is None:
            return "world"
        return next((label for label, g in self.groups.items() if g is group), "other")

    def _wrap(self, name: str, fn: Any) -> Any:
        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if self.on:
                measured = args[0] if name == "all_gather_into_tensor" else tensor  # (output, input, group=...)
                group = kwargs.get("group")
                if group is None and name == "all_reduce" and len(args) >= 2:
                    group = args[1]
                key = f"{name}/{self._label(group)}"
                entry = self.counts.setdefault(key, {"calls": 0, "bytes": 0})
                entry["calls"] += 1
                entry["bytes"] += int(measured.numel() * measured.element_size())
            return fn(tensor, *args, **kwargs)

        return counted


def rank_main(spec: dict[str, Any], out: Path) -> None:
    """One rank of one combination: build, initialize, ``spec['steps']`` steps; ``rank<R>.json`` in ``out``."""
    import deepspeed
    import torch
    import transformers
    from transformers.models.llama import modeling_llama  # the workload's import: before the meter, as in a probe

    from autofit.probe.rank import memory
    from autofit.probe.rank.meter import Meter

    rank = int(os.environ["RANK"])
    meter = Meter(torch, "cpu", None, lambda used: None)
    result: dict[str, Any] = {"rank": rank, "status": "ok"}
    phase = "init_distributed"
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        phase = "build"
        torch.manual_seed(SEED)
        config = transformers.LlamaConfig(**MODEL, attn_implementation="sdpa")
        model = modeling_llama.LlamaForCausalLM(config).float()
        model.config.use_cache = False
        result["full_params"] = sum(int(p.numel()) for p in model.parameters())
        if spec["ckpt"]:
            from autofit.ds.apply import apply_checkpointing

            apply_checkpointing(model, model.model.layers, 1.0)
        result["build_peak_bytes"] = meter.peak_bytes(final=False)
        phase = "initialize"
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=ds_config(spec["tp"], spec["stage"], spec["dp"],
                                                                spec.get("batch_over", "omit"),
                                                                spec.get("offload", "none")))
        result["initialize_peak_bytes"] = meter.peak_bytes(final=False)
        result["held_after_initialize_bytes"] = memory.settled_rss_bytes() - meter.baseline_bytes
        result["params"] = _split_params(engine.module)
        result["param_dtype"] = str(next(engine.module.parameters()).dtype)
        result["tp_layers"] = _layer_kinds(engine.module)
        from deepspeed.utils import groups

        tp_group = groups.get_tensor_model_parallel_group() if spec["tp"] > 1 else None
        result["dp_world_size"] = int(engine.dp_world_size)
        counter = _CommCounter({"tp": tp_group, "dp": engine.data_parallel_group})
        # this rank's data-parallel slice of the global batch: ranks of one TP group take the same samples
        dp_index = rank // spec["tp"]
        generator = torch.Generator().manual_seed(SEED)
        phase = "steps"
        losses, step_s = [], []
        memory.reset_peak()
        steps_base = memory.rss_bytes()
        for step in range(spec["steps"]):
            ids = torch.randint(0, MODEL["vocab_size"], (MICRO * spec["dp"], SEQ), generator=generator)
            ids = ids[dp_index * MICRO:(dp_index + 1) * MICRO]
            counter.on = step == 1  # one step's collectives, after the first (which checks the TP group's data)
            start = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            step_s.append(time.perf_counter() - start)
            counter.on = False
            losses.append(float(loss.detach()))
        result["steps_peak_above_held_bytes"] = memory.hwm_bytes() - steps_base
        result["peak_bytes"] = meter.peak_bytes(final=True)
        result["losses"] = losses
        result["step_s"] = [round(s, 4) for s in step_s]
        result["collectives_one_step"] = counter.counts
        result["optimizer_state_elements"] = _optimizer_state_elements(engine)
    except Exception as exc:  # noqa: BLE001 (a refusal is a result)
        result.update(status="error", phase=phase, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                      raised_at=(_deepspeed_frames(exc.__traceback__) or [None])[-1],
                      deepspeed_frames=_deepspeed_frames(exc.__traceback__),
                      traceback=traceback.format_exc().splitlines()[-12:])
    meter.stop_watchdog()
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo's atexit hooks can hang once a peer is gone


def trainer_main(stage: int, batch_key: str, out: Path) -> None:
    """One rank of the HF Trainer's run (under ``torch.distributed.run``): the same model and AutoTP 2 through
    ``Trainer`` with a JSON of ``"auto"`` values, ``train_batch_size`` ``"auto"`` or absent (``batch_key``)."""
    import torch
    from transformers import Trainer, TrainingArguments
    from transformers.models.llama import modeling_llama

    rank = int(os.environ["RANK"])
    ds: dict[str, Any] = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
                          "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": 2}}
    if batch_key == "auto":
        ds["train_batch_size"] = "auto"
    result: dict[str, Any] = {"rank": rank, "stage": stage, "train_batch_size": batch_key, "status": "ok"}
    try:
        torch.manual_seed(SEED)
        model = modeling_llama.LlamaForCausalLM(modeling_llama.LlamaConfig(**MODEL, attn_implementation="sdpa"))
        generator = torch.Generator().manual_seed(SEED)
        data = [{"input_ids": x, "labels": x} for x in torch.randint(0, MODEL["vocab_size"], (16, SEQ),
                                                                      generator=generator)]
        args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=MICRO, max_steps=3,
                                 deepspeed=ds, report_to=[], logging_steps=1, save_strategy="no", learning_rate=LR,
                                 use_cpu=True)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result["params"] = _split_params(trainer.model)
        result["dp_world_size"] = trainer.get_total_train_batch_size(args) // MICRO
    except Exception as exc:  # noqa: BLE001 (a refusal is a result)
        result.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                      raised_at=(_deepspeed_frames(exc.__traceback__) or [None])[-1],
                      deepspeed_frames=_deepspeed_frames(exc.__traceback__))
    (out / f"trainer_rank{rank}.json").write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    os._exit(0)


def run_trainer(stage: int, batch_key: str) -> list[dict[str, Any]]:
    """The HF Trainer's run on two ranks through ``torch.distributed.run``; each rank's JSON."""
    from autofit.probe.launch import available_cores, training_env

    env = training_env(dict(os.environ), "cpu", 2, available_cores())
    with tempfile.TemporaryDirectory(prefix="autotp_trainer_") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), "-m", "benchmarks.parallel.autotp_cpu", "--trainer-worker", str(stage), batch_key, tmp]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2 * RUN_TIMEOUT_S)
        paths = [Path(tmp) / f"trainer_rank{rank}.json" for rank in range(2)]
        return [json.loads(p.read_text()) if p.exists() else {"rank": i, "status": "no result",
                                                               "output_tail": done.stdout[-1000:] + done.stderr[-1000:]}
                for i, p in enumerate(paths)]


# --------------------------------------------------------------------------------------------------------------
# the driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_combination(tp: int, stage: int, ckpt: bool, dp: int, steps: int, batch_over: str = "omit",
                    offload: str = "none") -> dict[str, Any]:
    """Start the ``tp x dp`` ranks of one combination, wait for them, and gather their JSON."""
    from autofit.probe.launch import available_cores, training_env

    world = tp * dp
    spec = {"tp": tp, "stage": stage, "ckpt": ckpt, "dp": dp, "steps": steps, "batch_over": batch_over,
            "offload": offload}
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="autotp_cpu_") as tmp:
        procs = []
        start = time.perf_counter()
        for rank in range(world):
            env = training_env(dict(os.environ), "cpu", world, available_cores())
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            cmd = [sys.executable, "-m", "benchmarks.parallel.autotp_cpu", "--rank-worker", json.dumps(spec), tmp]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        outputs = []
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=max(1.0, RUN_TIMEOUT_S - (time.perf_counter() - start)))[0])
            except subprocess.TimeoutExpired:
                proc.kill()
                outputs.append(proc.communicate()[0])
        ranks = []
        for rank in range(world):
            path = Path(tmp) / f"rank{rank}.json"
            if path.exists():
                ranks.append(json.loads(path.read_text()))
            else:
                ranks.append({"rank": rank, "status": "no result", "output_tail": outputs[rank][-2000:]})
    return {**spec, "world": world, "wall_s": round(time.perf_counter() - start, 1), "ranks": ranks}


def _rank0_losses(row: dict[str, Any]) -> list[float] | None:
    """The global batch's loss a step: the mean over the data-parallel ranks (the first rank of each TP group)."""
    firsts = [r for r in row["ranks"] if r["rank"] % row["tp"] == 0]
    if not firsts or any(r.get("status") != "ok" for r in firsts):
        return None
    return [sum(r["losses"][i] for r in firsts) / len(firsts) for i in range(len(firsts[0]["losses"]))]


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each TP run against the reference (tp=1) of the same stage and checkpointing: the loss's worst relative
    difference over the steps, and each rank's held parameters and peaks beside the reference's."""
    out = []
    for row in rows:
        if row["tp"] == 1:
            continue
        ref = next((r for r in rows if r["tp"] == 1 and r["stage"] == row["stage"] and r["ckpt"] == row["ckpt"]
                    and r.get("offload", "none") == row.get("offload", "none")), None)
        entry: dict[str, Any] = {"stage": row["stage"], "ckpt": row["ckpt"], "tp": row["tp"], "dp": row["dp"],
                                 "offload": row.get("offload", "none")}
        ok = all(r.get("status") == "ok" for r in row["ranks"])
        entry["runs"] = ok
        if not ok:
            failed = next(r for r in row["ranks"] if r.get("status") != "ok")
            entry["error"] = failed.get("error", failed.get("status"))
            entry["raised_at"] = failed.get("raised_at")
        tp_losses, ref_losses = _rank0_losses(row), (_rank0_losses(ref) if ref else None)
        if tp_losses and ref_losses:
            rel = [abs(a - b) / abs(b) for a, b in zip(tp_losses, ref_losses, strict=True)]
            entry["loss_tp"], entry["loss_ref"] = tp_losses, ref_losses
            entry["loss_rel_diff_max"] = max(rel)
            entry["loss_rel_diff_per_step"] = rel
            entry["tp_ranks_agree"] = all(r["losses"] == row["ranks"][0]["losses"] for r in row["ranks"]
                                          if r["rank"] // row["tp"] == 0)
        if ok and ref and all(r.get("status") == "ok" for r in ref["ranks"]):
            keys = ("peak_bytes", "held_after_initialize_bytes", "steps_peak_above_held_bytes", "build_peak_bytes",
                    "optimizer_state_elements")
            entry["per_rank"] = [{"rank": r["rank"], "params": r["params"], **{k: r[k] for k in keys}}
                                 for r in row["ranks"]]
            entry["reference_rank0"] = {"params": ref["ranks"][0]["params"], **{k: ref["ranks"][0][k] for k in keys}}
        out.append(entry)
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--rank-worker":
        rank_main(json.loads(sys.argv[2]), Path(sys.argv[3]))
        return
    if len(sys.argv) == 5 and sys.argv[1] == "--trainer-worker":
        trainer_main(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--ckpt", choices=["off", "on", "both"], default="both")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (world = tp x dp)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--trainer", action="store_true",
                        help="only the HF Trainer's runs (ZeRO 3 with train_batch_size auto and absent, ZeRO 0 with "
                             "auto), written into --out's 'trainer' beside what it holds")
    parser.add_argument("--offload", action="store_true",
                        help="only ZeRO's CPU offloads beside TP (optimizer at ZeRO 1-3, parameters at ZeRO 3), written "
                             "into --out's 'offload' beside what it holds")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.offload:
        offload_rows = []
        for stage, offload in ((1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "params"), (3, "both")):
            for tp in (1, args.tp):
                row = run_combination(tp, stage, False, args.dp, args.steps, offload=offload)
                print(f"stage {stage} offload {offload} tp {tp}: "
                      + ",".join(r.get("status", "?") + (f" {r.get('error')}" if r.get("error") else "")
                                 for r in row["ranks"]), flush=True)
                offload_rows.append(row)
        existing = json.loads(args.out.read_text()) if args.out.exists() else {}
        existing["offload"] = {"command": "python -m benchmarks.parallel.autotp_cpu --offload",
                               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "rows": offload_rows, "comparison": compare(offload_rows)}
        args.out.write_text(json.dumps(existing, indent=1) + "\n")
        print(f"wrote {args.out}")
        return
    if args.trainer:
        trainer_rows = []
        for stage, batch_key in ((3, "auto"), (3, "absent"), (0, "auto")):
            ranks = run_trainer(stage, batch_key)
            print(f"Trainer, ZeRO {stage}, train_batch_size {batch_key}: "
                  + ",".join(r.get("status", "?") for r in ranks), flush=True)
            trainer_rows.append({"stage": stage, "train_batch_size": batch_key, "ranks": ranks})
        existing = json.loads(args.out.read_text()) if args.out.exists() else {}
        existing["trainer"] = {"command": "python -m benchmarks.parallel.autotp_cpu --trainer",
                               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "rows": trainer_rows}
        args.out.write_text(json.dumps(existing, indent=1) + "\n")
        print(f"wrote {args.out}")
        return
    ckpts = {"off": [False], "on": [True], "both": [False, True]}[args.ckpt]
    rows = []
    for stage in args.stages:
        for ckpt in ckpts:
            for tp in (1, args.tp):
                row = run_combination(tp, stage, ckpt, args.dp, args.steps)
                status = ",".join(r.get("status", "?") for r in row["ranks"])
                print(f"stage {stage} ckpt {'on' if ckpt else 'off'} tp {tp} dp {args.dp}: {status} "
                      f"({row['wall_s']} s)", flush=True)
                rows.append(row)
    # train_batch_size written out (ds_config): micro x world, the Trainer's, at ZeRO 0 and 3; micro x dp at ZeRO 0
    batch_key = []
    for batch_over, stage in (("world", 0), ("world", 3), ("dp", 0)):
        row = run_combination(args.tp, stage, False, args.dp, 2, batch_over=batch_over)
        print(f"train_batch_size = micro x {batch_over} under tp {args.tp}, stage {stage}: "
              + ",".join(r.get("status", "?") for r in row["ranks"]), flush=True)
        batch_key.append(row)
    import deepspeed
    import torch
    import transformers

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {
        "command": "python -m benchmarks.parallel.autotp_cpu " + " ".join(sys.argv[1:]),
        "commit": commit, "host": platform.node(), "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "model": {**MODEL, "seq_len": SEQ, "micro_batch": MICRO, "dtype": "fp32", "attention": "sdpa"},
        "seed": SEED, "steps": args.steps,
        "comparison": compare(rows),
        "runs": rows,
        "train_batch_size_written": batch_key,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
