"""ALST prototype on the CPU: Ulysses SP (DeepSpeed 0.19.8) + TiledMLP + tiled logits/loss + checkpoint offload.

Launch (2 CPU ranks, gloo):
    DS_ACCELERATOR=cpu /work/main/.venv/bin/python -m torch.distributed.run --nproc_per_node 2 \
        sp2_tiny.py --sp 2 [--tiled-mlp] [--tiled-loss N] [--ckpt none|plain|ds_offload]
Reference (1 rank):   ... --nproc_per_node 1 sp2_tiny.py --sp 1
Each rank prints one JSON line prefixed RESULT.

Data: SP rank r's own DataLoader yields the global batches B_r, B_{r+sp}, ...; UlyssesSPDataLoaderAdapter gathers one
batch from every SP rank and replays them one after another (each sharded on the sequence), so the SP run's
iterations see B_0, B_1, B_2, ... exactly like the SP=1 run (ulysses_sp.py UlyssesSPDataLoaderAdapter.refill).
"""

from __future__ import annotations

import argparse
import json
import math
import time


def rss_kib() -> tuple[int, int]:
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                k, v = line.split(":")
                vals[k] = int(v.split()[0])
    return vals["VmHWM"], vals["VmRSS"]


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sp", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--tiled-mlp", action="store_true")
    p.add_argument("--tiled-loss", type=int, default=0, help="shards of the fused logits+loss (0: off)")
    p.add_argument("--ckpt", default="none", choices=["none", "plain", "ds_offload"])
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--clip", type=float, default=0.0, help="DeepSpeed gradient_clipping (0: off; DeepSpeed's own default is 1.0)")
    p.add_argument("--no-sp-grad-fix", action="store_true",
                   help="backward the tutorial's aggregated loss as is under ZeRO 0-2 too (its gradients come out sp x too large)")
    args = p.parse_args()

    import deepspeed
    import deepspeed.comm as dist
    import torch
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        TiledMLP,
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
        sequence_tiled_compute,
    )
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    torch.set_num_threads(1)
    dist.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hwm_import, rss_import = rss_kib()

    if args.tiled_mlp:
        # the tutorial's monkey patch (ulysses_sp.py TiledMLP docstring): shards = ceil(seqlen / hidden), max over ranks
        def tiled_mlp_forward(self, x):
            bs, seqlen, hidden = x.shape
            n = torch.tensor(math.ceil(seqlen / hidden))
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
            compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]

            def mlp_forward(self, x):
                return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

            return TiledMLP.apply(mlp_forward, self, x, int(n.item()), compute_params)

        modeling_llama.LlamaMLP.forward = tiled_mlp_forward

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=4 * args.seq,
                      attn_implementation="sdpa", tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if args.ckpt in ("plain", "ds_offload"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    mpu = None
    if args.sp > 1:
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=args.sp,
            micro_batch_size=1, seq_length=args.seq, seq_length_is_variable=True)

    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.zero},
        "optimizer": {"type": "SGD", "params": {"lr": args.lr}},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "sequence_parallel_size": args.sp,
        "gradient_clipping": args.clip,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config, mpu=mpu)

    # global batches B_0..B_{n-1}: random tokens, fixed seed; SP rank r's loader holds B_r, B_{r+sp}, ...
    g = torch.Generator().manual_seed(1234)
    n_batches = args.steps
    tokens = torch.randint(0, args.vocab, (n_batches, args.seq), generator=g)
    sp_rank = mpu.get_sequence_parallel_rank() if mpu else 0
    mine = [i for i in range(n_batches + (args.sp - n_batches % args.sp) % args.sp) if i % args.sp == sp_rank]
    samples = [dict(input_ids=tokens[i % n_batches][None], position_ids=torch.arange(args.seq)[None],
                    labels=tokens[i % n_batches][None]) for i in mine]
    dl = torch.utils.data.DataLoader(samples, batch_size=None)
    if args.sp > 1:
        dl = UlyssesSPDataLoaderAdapter(dl, sp_rank=sp_rank, sp_group=mpu.get_sequence_parallel_group(),
                                        sp_world_size=args.sp, device=torch.device("cpu"))

    ctx = None
    if args.ckpt == "ds_offload":
        from deepspeed.runtime.activation_checkpointing.offload_activations import (
            get_checkpoint_hidden_states_offloading_ctx_manager,
        )
        ctx = get_checkpoint_hidden_states_offloading_ctx_manager()

    def loss_of(batch):
        if "shift_labels" in batch:
            shift = batch["shift_labels"]
        else:
            shift = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
        fwd = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        if args.tiled_loss:
            # the tutorial's tiled loss: sequence_tiled_compute re-runs lm_head+CE one tile at a time in backward, so
            # the logits (seq x vocab) exist one tile at a time. (TiledFusedLogitsLoss does the backward inside forward
            # with an incoming gradient of 1 and only rescales x's gradient afterwards: lm_head's weight gradient then
            # ignores any scale applied to the loss later (1/n_tokens, SP weights, 1/GA) -- see REPORT.md.)
            hidden = engine.module.model(**fwd).last_hidden_state

            def loss_fn(hidden_states=None, shift_labels=None, lm_head=None):
                logits = lm_head(hidden_states).float()
                return F.cross_entropy(logits.view(-1, args.vocab), shift_labels.reshape(-1), ignore_index=-100,
                                       reduction="sum")

            lm_head = engine.module.lm_head
            total = sequence_tiled_compute(
                loss_fn, hidden.shape[1], args.tiled_loss, dict(hidden_states=hidden, shift_labels=shift),
                dict(lm_head=lm_head), "hidden_states", [lm_head.weight], output_unshard_dimension=0,
                output_reduction="sum")
            good = (shift != -100).sum()
            loss = total / good.clamp(min=1)
        else:
            logits = engine(**fwd).logits
            loss = F.cross_entropy(logits.float().view(-1, args.vocab), shift.reshape(-1), ignore_index=-100)
        if args.sp > 1:  # the tutorial's weighted, differentiable aggregation over the SP group
            group = mpu.get_sequence_parallel_group()
            losses = torch.distributed.nn.functional.all_gather(loss, group=group)
            good = (shift != -100).view(-1).sum()
            goods = torch.distributed.nn.functional.all_gather(good, group=group)
            loss = sum(l * n for l, n in zip(losses, goods)) / max(sum(goods), 1)
        return loss

    _, rss_before = rss_kib()
    def backward_loss(loss):
        # torch.distributed.nn.functional.all_gather's backward SUMS the gradient of every rank's copy of the
        # aggregated loss (torch/distributed/nn/functional.py _AllGather.backward): each rank's gradient is sp x its
        # share. ZeRO-3's reduce-scatter divides by the whole world (comm/coalesced_collectives.py
        # reduce_scatter_coalesced), which cancels it; ZeRO 0-2 divide by world/sp only (stage_1_and_2.py
        # average_tensor / allreduce_bucket), which leaves sp x the true gradient. Measured: matrix/sp2_nofix, sp2_z3*.
        if args.sp > 1 and not args.no_sp_grad_fix and args.zero < 3:
            return loss / args.sp
        return loss

    reset_hwm()
    losses, gnorms, times = [], [], []
    it = iter(dl)
    for step in range(args.steps):
        batch = next(it)
        t0 = time.perf_counter()
        if ctx is not None:
            with ctx:
                loss = loss_of(batch)
                engine.backward(backward_loss(loss))
        else:
            loss = loss_of(batch)
            engine.backward(backward_loss(loss))
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        gn = engine.get_global_grad_norm()
        gnorms.append(None if gn is None else float(gn))
    hwm, rss = rss_kib()
    out = dict(rank=rank, world=world, sp=args.sp, zero=args.zero, tiled_mlp=args.tiled_mlp, tiled_loss=args.tiled_loss,
               ckpt=args.ckpt, seq=args.seq, clip=args.clip, sp_grad_fix=(not args.no_sp_grad_fix and args.zero < 3), losses=losses, grad_norms=gnorms, step_s=times,
               rss_after_import_kib=rss_import, peak_rss_kib=hwm, peak_minus_import_kib=hwm - rss_import,
               rss_before_steps_kib=rss_before, step_peak_minus_before_kib=hwm - rss_before,
               batch_local_seq=int(batch["input_ids"].shape[1]))
    if ctx is not None:
        out["offload_stats"] = vars(ctx.stats)
    print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
