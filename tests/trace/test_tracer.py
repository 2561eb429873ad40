"""The trace: live bytes on fake tensors, per micro-batch, precision and checkpointing; exact-config traces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.cost_model import ModelFacts
from autofit.probe.launch import MMAP_THRESHOLD_BYTES
from autofit.trace import parallel, trace_config, trace_workload
from autofit.trace.step import LiveBytes, make_tracker
from autofit.workload.entry import load_workload
from autofit.workload.types import Workload

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

WIDTH, TOKENS, N_LAYERS = 64, 32, 4


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)) for _ in range(N_LAYERS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x.pow(2).mean()


def tiny_workload() -> Workload:
    return Workload(model=Tiny, batch=lambda n: torch.randn(n, TOKENS, WIDTH), name="tiny")


@pytest.fixture(scope="module")
def tiny_facts() -> ModelFacts:
    """The tiny model traced once for the tests that read its facts (frozen: shared safely), fp32 and bf16."""
    return trace_workload(tiny_workload(), precisions=("fp32", "bf16"))


def test_tracker_counts_each_new_storage_once_and_frees_it() -> None:
    counter = LiveBytes()
    with make_tracker(counter):
        a = torch.ones(1000)  # 4000 B
        b = a.view(10, 100).t()  # a view: no new storage
        assert counter.live == 4000
        c = a * 2
        assert counter.live == 8000
        del a, b
        assert counter.live == 4000
        del c
    assert counter.live == 0
    assert counter.peak_with_grads == 8000


def test_activation_bytes_grow_with_the_batch_and_fall_with_checkpointing(tiny_facts: ModelFacts) -> None:
    facts = tiny_facts
    full = facts.profile("fp32", "sdpa", False)
    ckpt = facts.profile("fp32", "sdpa", True)
    assert full.at(4, "activation_bytes") > full.at(1, "activation_bytes") > 0
    # each layer saves its input, its hidden (4x) and its GELU output: 9 x its input bytes per sample
    per_sample_input = TOKENS * WIDTH * 4
    assert full.at(4, "activation_bytes") - full.at(1, "activation_bytes") >= 3 * N_LAYERS * 9 * per_sample_input
    assert ckpt.at(4, "activation_bytes") < full.at(4, "activation_bytes") / 3
    assert ckpt.at(4, "flops") > full.at(4, "flops")  # recompute


def test_bf16_trace_halves_the_bytes(tiny_facts: ModelFacts) -> None:
    facts = tiny_facts
    fp32 = facts.profile("fp32", "sdpa", False).at(4, "activation_bytes")
    bf16 = facts.profile("bf16", "sdpa", False).at(4, "activation_bytes")
    assert bf16 == pytest.approx(fp32 / 2, rel=0.05)


def test_structure_counts_parameters_and_adafactor_factors(tiny_facts: ModelFacts) -> None:
    facts = tiny_facts
    per_layer = 2 * WIDTH * 4 * WIDTH + 4 * WIDTH + WIDTH
    assert facts.n_params == facts.n_trainable_params == N_LAYERS * per_layer
    assert facts.n_layers == N_LAYERS and facts.layer_params == (per_layer,) * N_LAYERS
    assert facts.factored_state_numel == N_LAYERS * (2 * (WIDTH + 4 * WIDTH) + 4 * WIDTH + WIDTH)


def test_trace_config_is_exact_at_the_configs_micro_batch(tiny_facts: ModelFacts) -> None:
    interpolated = tiny_facts.profile("fp32", "sdpa", False)
    exact = trace_config(tiny_workload(), Config(micro_batch_size=4))
    assert exact.n_layers == 0
    point = exact.profile("fp32", "sdpa", False).points[0]
    assert point.micro_batch_size == 4
    assert point.activation_bytes == interpolated.at(4, "activation_bytes")


def test_trace_never_allocates_a_large_model() -> None:
    """A 4 x 8192^2 model (~1 GiB of fp32 weights) traces on fake tensors."""

    class Large(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8192, 8192) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x.mean()

    facts = trace_workload(Workload(model=Large, batch=lambda n: torch.randn(n, 8192), name="large"))
    assert facts.trace_mode == "fake"
    assert facts.n_params == 4 * (8192 * 8192 + 8192)


def test_sdpa_attention_flops_are_counted_on_the_cpu() -> None:
    """torch's FLOP counter has no formula for the CPU's flash SDPA kernel; the trace adds torch's own."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from autofit.trace import sdpa_flop_formulas

    q = torch.randn(2, 4, 128, 64, requires_grad=True)

    def counted(attention, mapping=None) -> int:
        counter = FlopCounterMode(display=False, custom_mapping=mapping)
        with counter:
            attention(q).sum().backward()
        return int(counter.get_total_flops())

    def sdpa(x):
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)

    def eager(x):
        return ((x @ x.transpose(-1, -2)) / 8).softmax(-1) @ x

    # the same matmuls as eager attention, plus the scores the backward recomputes
    assert counted(eager) < counted(sdpa, sdpa_flop_formulas()) < 1.25 * counted(eager)


def test_grouped_query_sdpa_counts_the_flops_of_its_keys_broadcast_to_the_query_heads() -> None:
    """A GQA model's SDPA call (8 query heads, 2 key/value heads, ``enable_gqa``) counts what the same call with
    the keys and values repeated to 8 heads counts: the kernel broadcasts them (torch before 2.13 failed here)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from autofit.trace import sdpa_flop_formulas

    q = torch.randn(2, 8, 64, 32, requires_grad=True)
    kv = torch.randn(2, 2, 64, 32, requires_grad=True)

    def counted(k, v, **kwargs) -> int:
        counter = FlopCounterMode(display=False, custom_mapping=sdpa_flop_formulas())
        with counter:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs).sum().backward()
        return int(counter.get_total_flops())

    grouped = counted(kv, kv, enable_gqa=True)
    repeated = kv.repeat_interleave(4, dim=1)
    assert grouped == counted(repeated, repeated) > 0


def test_flash_is_traced_through_sdpas_flash_backend_and_labelled_so() -> None:
    """Without flash-attn (this machine), flash is SDPA forced to its flash backend; the facts say so."""
    from autofit.trace.attention import FLASH_ATTN, SDPA_FLASH, flash_attn_installed, flash_trace_plan

    assert flash_trace_plan(True) == [("flash", FLASH_ATTN), ("sdpa", SDPA_FLASH)]
    assert flash_trace_plan(False) == [("sdpa", SDPA_FLASH)]
    assert flash_trace_plan(False, "stand-in") == [("stand-in", SDPA_FLASH)]
    if flash_attn_installed():
        pytest.skip("flash-attn is installed: flash traces through it")
    facts = trace_workload(load_workload(f"{EXAMPLES / 'gpt.py'}:workload"), precisions=("bf16",),
                           attentions=("sdpa", "flash"))
    assert facts.attention_traces == {"flash": SDPA_FLASH}
    flash, sdpa = facts.profile("bf16", "flash", False).points, facts.profile("bf16", "sdpa", False).points
    assert [p.activation_bytes for p in flash] == [p.activation_bytes for p in sdpa]  # the CPU's SDPA is flash-style


def test_a_space_past_the_traced_sizes_is_traced_at_its_largest_micro_batch() -> None:
    """Not extrapolated from micro-batches 1 and 4 (trace_micro_batches): the planned facts hold a trace at 32,
    the same bytes an exact trace of that config has, checkpointed or not."""
    from autofit.planning.plan import trace_for

    workload = tiny_workload()
    configs = [Config(micro_batch_size=n, checkpoint_ratio=r) for n in (1, 8, 32) for r in (0.0, 1.0)]
    facts = trace_for(workload, configs)
    for ratio in (0.0, 1.0):
        profile = facts.profile("fp32", "sdpa", ratio == 1.0)
        assert [p.micro_batch_size for p in profile.points] == [1, 4, 32]
        exact = trace_config(workload, Config(micro_batch_size=32, checkpoint_ratio=ratio)).profile("fp32", "sdpa", False)
        assert profile.at(32, "peak_with_grads_bytes") == exact.points[0].peak_with_grads_bytes


def test_a_tied_head_keeps_one_gradient_in_bf16() -> None:
    """The GPT's head shares the embedding's weight: cast to bf16 it is still one parameter with one gradient,
    half the fp32 gradient bytes (it was cast twice, and traced with two gradients)."""
    workload = load_workload(f"{EXAMPLES / 'gpt.py'}:workload")
    fp32, bf16 = (trace_config(workload, Config(micro_batch_size=1, precision=p)) for p in ("fp32", "bf16"))
    grads = [f.profiles[next(iter(f.profiles))].points[0].grad_bytes for f in (fp32, bf16)]
    assert grads[0] == 4 * fp32.n_trainable_params and grads[1] == grads[0] // 2


class _NoFlops:
    """A stand-in for the trace's FLOP counter that counts nothing and hooks nothing."""

    def __enter__(self) -> _NoFlops:
        return self

    def __exit__(self, *args: object) -> None:
        return None

    def get_total_flops(self) -> int:
        return 0

    def get_flop_counts(self) -> dict:
        return {}

    def run(self, func: Any, args: Any, kwargs: Any) -> Any:
        return func(*args, **kwargs)


class _StockFlops(_NoFlops):
    """torch's own FlopCounterMode, entered as the dispatch mode it is (the trace's counter counts inline instead)."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        from autofit.trace.tensors import sdpa_flop_formulas

        self.mode = FlopCounterMode(display=False, custom_mapping=sdpa_flop_formulas())

    def __enter__(self) -> _StockFlops:
        self.mode.__enter__()
        return self

    def __exit__(self, *args: object) -> None:
        self.mode.__exit__(*args)

    def get_total_flops(self) -> int:
        return int(self.mode.get_total_flops())

    def get_flop_counts(self) -> dict:
        return dict(self.mode.get_flop_counts())


def test_counting_flops_keeps_no_checkpointed_recompute_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's FlopCounterMode hooked every recomputed module's tensors and so kept the recompute's graph alive to
    the end of backward (GPT mb4, every block checkpointed: 34.7 MiB where 26.9): the trace's counter must
    count the same FLOPs as torch's and leave the live bytes as they are without any counter."""
    import autofit.trace.step as trace
    from autofit.trace.step import trace_step as _trace_step

    gpt = load_workload(f"{EXAMPLES}/gpt.py:workload")
    counted = _trace_step(gpt, 4, "fp32", "sdpa", (1.0, "block"), "fake")
    monkeypatch.setattr(trace, "flop_counter", _NoFlops)
    uncounted = _trace_step(gpt, 4, "fp32", "sdpa", (1.0, "block"), "fake")
    monkeypatch.setattr(trace, "flop_counter", _StockFlops)
    stock = _trace_step(gpt, 4, "fp32", "sdpa", (1.0, "block"), "fake")
    assert counted.peak_with_grads_bytes == uncounted.peak_with_grads_bytes
    assert counted.flops == stock.flops > 0
    assert stock.peak_with_grads_bytes > counted.peak_with_grads_bytes  # the leak this guards against


class SharedInput(nn.Module):
    """Every layer reads one tensor that needs a gradient (a decoder's encoder output, T5's position bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(CrossLayer() for _ in range(N_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(x)
        for layer in self.layers:
            x = layer(x, memory)
        return x.pow(2).mean()


class CrossLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x * memory)


def test_the_trackers_hold_no_gradient_of_a_layer_whose_input_is_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's multi-grad hooks (the module trackers' way to see a layer's backward end) keep each input's gradient
    until every input has one; an input shared by all layers has its gradient only at the end of backward (T5 mb16,
    every block checkpointed: 122.7 MiB traced where 102.6 were measured). The trace's trackers count instead."""
    import autofit.trace.hooks as trace_hooks
    import autofit.trace.step as trace
    from autofit.trace.step import trace_step as _trace_step

    shared = Workload(model=SharedInput, batch=lambda n: torch.randn(n, TOKENS, WIDTH), name="shared")
    counted = _trace_step(shared, 8, "fp32", "sdpa", (1.0, "block"), "fake")
    monkeypatch.setattr(trace, "flop_counter", _NoFlops)
    uncounted = _trace_step(shared, 8, "fp32", "sdpa", (1.0, "block"), "fake")
    monkeypatch.setattr(trace_hooks, "counting_multi_grad_hook", torch.autograd.graph.register_multi_grad_hook)
    buffering = _trace_step(shared, 8, "fp32", "sdpa", (1.0, "block"), "fake")
    assert counted.peak_with_grads_bytes == uncounted.peak_with_grads_bytes
    assert buffering.peak_with_grads_bytes > counted.peak_with_grads_bytes  # what the counting hooks take away


def test_a_counting_multi_grad_hook_fires_once_every_reached_tensor_has_its_gradient() -> None:
    from autofit.trace.hooks import counting_multi_grad_hook

    a, b, unused = (torch.ones(3, requires_grad=True) for _ in range(3))
    calls: list[list[None]] = []
    counting_multi_grad_hook([a, b, unused], calls.append)
    (a * 2 + b).sum().backward()
    assert calls == [[None, None, None]]
    (a * 3).sum().backward()  # b is not reached by this backward: the hook waits for a alone
    assert len(calls) == 2


#: one plain forward and backward of the probe tests' conv net, its resident peak (the third, after the kernels'
#: first-use allocations), in a process that returns freed tensors to the OS (docs/design.md, "Memory, measured")
CONV_STEP = """
import sys, torch
from autofit.probe.rank.memory import hwm_bytes, reset_peak, rss_bytes
from autofit.workload.entry import load_workload
torch.manual_seed(0)
workload = load_workload(sys.argv[1])
net, batch = workload.build_model(), workload.batch(16)
for _ in range(3):
    net.zero_grad(set_to_none=True)
    base = rss_bytes()
    reset_peak()
    workload.compute_loss(net, batch).backward()
print(hwm_bytes() - base)
"""
CONVNET = f"{Path(__file__).resolve().parents[1] / 'probe' / 'probe_workloads.py'}:convnet"


@pytest.mark.slow
def test_a_conv_nets_trace_counts_the_copies_its_convolutions_make() -> None:
    """oneDNN reorders a convolution's operands into blocked layouts, copies no tensor shows; the trace adds them
    (``kernel_workspace_bytes``). Six 3x3 convolutions of 64 channels at micro-batch 16: a plain forward and backward
    peaked at 159.9-160.2 MiB, the trace says 160.1; without the copies it said ~144 (-10%)."""
    import os
    import subprocess
    import sys

    from autofit.cost_model.memory import activation_peak_bytes
    from autofit.planning.plan import trace_for

    config = Config(micro_batch_size=16, checkpoint_ratio=0.0, precision="fp32", optimizer="sgd", zero_stage=0)
    traced = activation_peak_bytes(config, trace_for(load_workload(CONVNET), [config]), keep_grads=True)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD_BYTES), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", CONV_STEP, CONVNET], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    assert traced == pytest.approx(int(done.stdout.split()[-1]), rel=0.04)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "2.5", "\u00b2"])
def test_trace_workers_that_is_not_a_positive_integer_is_one_line_from_the_cli(
        value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A setting meant to limit the load is never read as "one per core": the CLI says which variable and value
    are wrong, on one line, and exits 1 (examples/mlp.py is not cut: the setting is checked before any trace)."""
    from click.testing import CliRunner

    from autofit.cli import main

    monkeypatch.setenv(parallel.TRACE_WORKERS_ENV, value)
    result = CliRunner().invoke(main, ["estimate", f"{EXAMPLES}/mlp.py:workload", "--hardware", "cpu", "--no-cache"])
    assert result.exit_code == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("autofit: error: AUTOFIT_TRACE_WORKERS=") and repr(value) in line


def test_trace_workers_reads_a_positive_integer_and_defaults_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(parallel.TRACE_WORKERS_ENV, " 3 ")
    assert parallel.trace_workers() == 3
    monkeypatch.setenv(parallel.TRACE_WORKERS_ENV, "")
    assert parallel.trace_workers_setting() is None
    monkeypatch.delenv(parallel.TRACE_WORKERS_ENV)
    assert 1 <= parallel.trace_workers() <= parallel.MAX_TRACE_WORKERS
    monkeypatch.setenv(parallel.TRACE_WORKERS_ENV, "00")
    with pytest.raises(AutofitError, match="AUTOFIT_TRACE_WORKERS='00' is not a positive integer"):
        parallel.trace_workers()
