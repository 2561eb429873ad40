"""The GPU check's host micro-benchmark: what a step costs the CPU that drives the GPU, measured on its own.

    python -m benchmarks.gpu.gpu_check_host --part HOST.json

The time model prices the device's work; at a small micro-batch the host that launches it is the bound (issue 48:
ZeRO-3 at micro-batch 4 ran 5x under its prediction on an H100). The host model's constants come from here, from
programs that share nothing with the grid's rows they are judged on:

- ``launch``: one tiny elementwise op (``torch.add(x, 1, out=y)`` on one element) issued many times without a sync:
  the host's cost of one kernel launch through PyTorch's dispatcher, and the same with a sync after each (the
  round trip);
- ``mlp``: forward and backward of a stack of small ``Linear`` + ReLU layers outside DeepSpeed at two depths: the
  host's cost per layer of autograd (its slope) and per step (its intercept);
- ``engine``: the same stacks through ``deepspeed.initialize`` in bf16 with AdamW (FusedAdam on CUDA) at ZeRO 0, 1, 2
  and 3, every step timed: what DeepSpeed adds per step, per parameter tensor (the optimizer's and the gradient
  hooks') and, at ZeRO-3, per module (its fetch and release hooks), as the slopes between the two depths; at ZeRO-3
  once more without biases (one tensor a module: the module's share and the tensor's apart);
- ``decoder``: a tiny Llama decoder (transformers, width 64) at two depths, plain and with every layer checkpointed,
  and through DeepSpeed at ZeRO 0 and 3: the host's cost per op of a real transformer layer's Python, and what
  checkpointing's hooks add beyond the recompute's ops (the ops are counted on any machine, as the trace counts them).

Every figure is a median of timed repeats after warm-up ones; the raw step times are kept.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

from benchmarks.gpu.gpu_check_profiles import save

#: the two depths of the layer stacks (their difference gives the per-layer slope)
DEPTHS = (16, 64)
#: the two depths of the tiny decoder
DECODER_DEPTHS = (2, 6)
#: width of each layer: small enough that the device's work is far below the host's
WIDTH = 64
STAGES = (0, 1, 2, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", required=True)
    parser.add_argument("--quick", action="store_true", help="Fewer repeats (the dry run).")
    args = parser.parse_args(argv)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
        os.environ.setdefault(key, value)
    import deepspeed
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    found: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
                             "torch": torch.__version__, "deepspeed": deepspeed.__version__}
    repeats = 3 if args.quick else 10
    found["launch"] = launch(torch, device, 2_000 if args.quick else 20_000)
    save(args.part, found)
    found["mlp"] = {str(depth): mlp(torch, device, depth, repeats) for depth in DEPTHS}
    save(args.part, found)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    found["engine"] = {}
    for stage in STAGES:
        for depth in DEPTHS:
            found["engine"][f"z{stage}_L{depth}"] = engine(torch, deepspeed, device, stage, depth, repeats)
            save(args.part, found)
    for depth in DEPTHS:
        found["engine"][f"z3nobias_L{depth}"] = engine(torch, deepspeed, device, 3, depth, repeats, bias=False)
        save(args.part, found)
    found["decoder"] = {}
    for depth in DECODER_DEPTHS:
        for checkpointed in (False, True):
            for stage in (None, 0, 3):
                key = f"{'plain' if stage is None else f'z{stage}'}_L{depth}{'_ckpt' if checkpointed else ''}"
                found["decoder"][key] = decoder(torch, deepspeed, device, depth, checkpointed, stage, repeats)
                save(args.part, found)
    found["summary"] = summary(found)
    found["ok"] = True
    save(args.part, found)
    sys.stdout.flush()
    os._exit(0)


def sync_of(torch: Any, device: Any) -> Any:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def launch(torch: Any, device: Any, n: int) -> dict[str, float]:
    """Seconds per tiny op: queued back to back (the host's launch cost) and synced after each (the round trip)."""
    sync = sync_of(torch, device)
    x, y = torch.zeros(1, device=device), torch.empty(1, device=device)
    for _ in range(100):
        torch.add(x, 1, out=y)
    sync()
    queued = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            torch.add(x, 1, out=y)
        sync()
        queued.append((time.perf_counter() - t0) / n)
    synced = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n // 10):
            torch.add(x, 1, out=y)
            sync()
        synced.append((time.perf_counter() - t0) / (n // 10))
    return {"queued_s": statistics.median(queued), "synced_s": statistics.median(synced), "n": n}


def stack(torch: Any, depth: int, bias: bool = True) -> Any:
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(WIDTH, WIDTH, bias=bias), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def mlp(torch: Any, device: Any, depth: int, repeats: int) -> dict[str, Any]:
    """Forward and backward of ``depth`` layers in bf16 (fp32 on the CPU), no optimizer: seconds per step."""
    sync = sync_of(torch, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = stack(torch, depth).to(device=device, dtype=dtype)
    x = torch.randn(4, WIDTH, device=device, dtype=dtype)
    times = []
    for index in range(repeats + 3):
        sync()
        t0 = time.perf_counter()
        model(x).float().pow(2).mean().backward()
        sync()
        if index >= 3:
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "step_times_s": times, "layers": depth, "tensors": 2 * depth}


def engine(torch: Any, deepspeed: Any, device: Any, stage: int, depth: int, repeats: int,
           bias: bool = True) -> dict[str, Any]:
    """Steps of ``depth`` layers through DeepSpeed at ZeRO ``stage`` with the product's JSON (bf16, AdamW): every
    step's seconds and the optimizer's own, the first three warm-up."""
    from autofit.core.config import Config
    from autofit.ds.emit import deepspeed_config

    cuda = device.type == "cuda"
    config = Config(micro_batch_size=4, precision="bf16" if cuda else "fp32", zero_stage=stage, optimizer="adamw",
                    attention="sdpa")
    ds = deepspeed_config(config, 1, "cuda" if cuda else "cpu", hidden_size=WIDTH)
    if stage == 3:  # no parameter kept whole: every module's hooks gather and release (the cost measured)
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if stage == 3:  # built inside zero.Init, as the product builds (zero.Init(module=...) would keep fp32)
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = stack(torch, depth, bias)
    else:
        model = stack(torch, depth, bias)
    dtype = torch.bfloat16 if cuda else torch.float32
    x = torch.randn(4, WIDTH, device=device, dtype=dtype)
    timed = engine_steps(torch, deepspeed, model, ds, lambda held: held(x).float().pow(2).mean(), repeats, device)
    return timed | {"layers": depth, "tensors": (2 if bias else 1) * depth, "zero_stage": stage}


def engine_steps(torch: Any, deepspeed: Any, model: Any, ds: dict[str, Any], loss: Any, repeats: int,
                 device: Any) -> dict[str, Any]:
    """``deepspeed.initialize`` of ``model`` with ``ds``, ``repeats`` + 3 steps of ``loss(engine)`` each timed (the
    first three warm-up), the engine destroyed and its memory given back."""
    from autofit.probe.rank.steps import train_step

    held, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)
    sync = sync_of(torch, device)
    steps, optimizer = [], []
    try:
        for _ in range(repeats + 3):
            seconds, opt, _ = train_step(held, lambda: loss(held), 1, sync)
            steps.append(seconds)
            optimizer.append(opt)
    finally:
        held.destroy()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"step_s": statistics.median(steps[3:]), "optimizer_s": statistics.median(optimizer[3:]),
            "step_times_s": steps, "optimizer_times_s": optimizer}


def decoder_model(depth: int) -> Any:
    """A tiny Llama (width 64, 4 heads, 2 key-value heads, 256 tokens of vocabulary) with ``depth`` layers."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                      num_hidden_layers=depth, num_attention_heads=4, num_key_value_heads=2,
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def decoder(torch: Any, deepspeed: Any, device: Any, depth: int, checkpointed: bool, stage: int | None,
            repeats: int) -> dict[str, Any]:
    """Steps of the tiny decoder: plain autograd (``stage`` None) or through DeepSpeed at ZeRO ``stage``; every layer
    checkpointed as the product checkpoints (:func:`autofit.ds.apply.apply_checkpointing`) where ``checkpointed``."""
    from autofit.core.config import Config
    from autofit.ds.apply import apply_checkpointing
    from autofit.ds.emit import deepspeed_config

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    ids = torch.randint(0, 256, (2, 32), device=device)
    sync = sync_of(torch, device)
    if stage is None:
        model = decoder_model(depth).to(device=device, dtype=dtype)
        if checkpointed:
            apply_checkpointing(model, list(model.model.layers), 1.0)
        times = []
        for _ in range(repeats + 3):
            sync()
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            sync()
            times.append(time.perf_counter() - t0)
        return {"step_s": statistics.median(times[3:]), "step_times_s": times, "layers": depth}
    config = Config(micro_batch_size=2, precision="bf16" if cuda else "fp32", zero_stage=stage, optimizer="adamw",
                    attention="sdpa", checkpoint_ratio=1.0 if checkpointed else 0.0)
    ds = deepspeed_config(config, 1, "cuda" if cuda else "cpu", hidden_size=WIDTH)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds):
            model = decoder_model(depth)
    else:
        model = decoder_model(depth)
    if checkpointed:
        apply_checkpointing(model, list(model.model.layers), 1.0)
    timed = engine_steps(torch, deepspeed, model, ds, lambda held: held(input_ids=ids, labels=ids).loss, repeats, device)
    return timed | {"layers": depth, "zero_stage": stage}


def summary(found: dict[str, Any]) -> str:
    per_layer = {}
    for stage in STAGES:
        short, long = (found["engine"][f"z{stage}_L{d}"]["step_s"] for d in DEPTHS)
        per_layer[stage] = (long - short) / (DEPTHS[1] - DEPTHS[0])
    mlp_short, mlp_long = (found["mlp"][str(d)]["step_s"] for d in DEPTHS)
    return (f"launch {found['launch']['queued_s'] * 1e6:.1f} us queued, {found['launch']['synced_s'] * 1e6:.1f} us "
            f"synced; autograd {(mlp_long - mlp_short) / (DEPTHS[1] - DEPTHS[0]) * 1e6:.0f} us a layer; DeepSpeed "
            + ", ".join(f"z{s} {v * 1e6:.0f}" for s, v in per_layer.items()) + " us a layer")


if __name__ == "__main__":
    sys.exit(main())
