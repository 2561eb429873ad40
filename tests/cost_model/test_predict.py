"""Golden figures for the cost model: the ZeRO paper, the seeds' 7B examples, and its composition rules."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autofit.core.config import Config
from autofit.cost_model import Coefficients, predict
from autofit.cost_model.facts import ActivationProfile, ModelFacts, PeakPoint
from autofit.cost_model.states import model_states, optimizer_state_bytes
from autofit.machine.device import get_hardware

GB = 1e9


def facts_with(n_params: int, n_layers: int = 4, act_per_sample: int = 1000, flops_per_sample: int = 10**9) -> ModelFacts:
    """Synthetic facts: activations and FLOPs linear in the micro-batch, checkpointing halves activations."""

    def profile(dtype: str, ckpt: bool) -> ActivationProfile:
        scale = (2 if dtype == "fp32" else 1) * (0.5 if ckpt else 1.0)
        points = tuple(
            PeakPoint(
                micro_batch_size=n,
                peak_with_grads_bytes=int(n * act_per_sample * scale) + 4 * n_params,
                peak_without_grads_bytes=int(n * act_per_sample * scale),
                activation_bytes=int(n * act_per_sample * scale),
                grad_bytes=4 * n_params,
                flops=int(n * flops_per_sample * (4 / 3 if ckpt else 1)),
            )
            for n in (1, 2, 4)
        )
        return ActivationProfile(dtype=dtype, attention="sdpa", checkpointed=ckpt, points=points)

    return ModelFacts(
        name="synthetic", n_params=n_params, n_trainable_params=n_params, n_layers=n_layers,
        layer_params=(n_params // n_layers,) * n_layers, largest_module_params=n_params // n_layers,
        largest_param_numel=n_params // (2 * n_layers), n_small_params=0, factored_state_numel=n_params // 100,
        n_param_tensors=2 * n_layers, n_persistent_params=0, buffer_bytes=0, tokens_per_sample=None,
        profiles={ActivationProfile.key(d, "sdpa", c): profile(d, c) for d in ("fp32", "bf16") for c in (False, True)},
    )


@pytest.mark.parametrize(
    ("stage", "params_gb", "grads_gb", "optimizer_gb"),
    [(0, 15.0, 15.0, 90.0), (1, 15.0, None, 1.41), (2, 15.0, None, 1.41), (3, 0.23, 0.23, 1.41)],
)
def test_zero_paper_7_5b_on_64_gpus(stage: int, params_gb: float, grads_gb: float | None, optimizer_gb: float) -> None:
    """Rajbhandari et al. 2020, Figure 1 (7.5B parameters, N_d = 64, mixed-precision Adam, K = 12): the
    product's terms per stage. Parameters 2 Psi (2 Psi / N_d under P_os+g+p) and the K Psi of fp32 master
    and Adam states (/ N_d from P_os) are the paper's exactly. Gradients are the paper's where DeepSpeed
    keeps them as the paper does (stage 0: 2 Psi; stage 3: a 16-bit partition); stages 1/2 hand the
    optimizer an fp32 partition instead (stage_1_and_2.py), not the paper's 16-bit gradients."""
    facts = facts_with(7_500_000_000, n_layers=64)
    states = model_states(Config(precision="bf16", optimizer="adamw", zero_stage=stage), facts, 64, "cuda")
    assert states.params / GB == pytest.approx(params_gb, abs=0.01)
    assert (states.master + states.optimizer) / GB == pytest.approx(optimizer_gb, abs=0.01)
    if stage == 0:
        assert states.grads_step / GB == pytest.approx(grads_gb)
        assert (states.params + states.grads_step + states.master + states.optimizer) / GB == pytest.approx(120.0)
    if stage == 3:  # the 16-bit gradient partition, beside DeepSpeed's reduce bucket
        bucket = model_states(Config(precision="bf16", zero_stage=3), facts, 10**9, "cuda").grads_resident
        assert (states.grads_resident - bucket) / GB == pytest.approx(grads_gb, abs=0.01)


@pytest.mark.parametrize(("stage", "params_gb", "grads_gb", "optimizer_gb"),
                         [(0, 14.0, 14.0, 28.0), (1, 14.0, None, 3.5), (2, 14.0, None, 3.5), (3, 1.75, 1.75, 3.5)])
def test_seed_7b_bf16_on_8_gpus(stage: int, params_gb: float, grads_gb: float | None, optimizer_gb: float) -> None:
    """The seed guide's 7B / 8-GPU bf16 table (seeds/001, "ZeRO Memory Savings") through the product: its
    optimizer column is 4 B/param (one fp32 state, Lion's); the product adds the fp32 master copy DeepSpeed
    keeps for 16-bit training, which the table leaves out."""
    facts = facts_with(7_000_000_000, n_layers=32)
    states = model_states(Config(precision="bf16", optimizer="lion", zero_stage=stage), facts, 8, "cuda")
    assert states.params / GB == pytest.approx(params_gb)
    assert states.optimizer / GB == pytest.approx(optimizer_gb)
    if stage == 0:
        assert states.grads_step / GB == pytest.approx(grads_gb)
    if stage == 3:
        bucket = model_states(Config(precision="bf16", zero_stage=3), facts, 10**9, "cuda").grads_resident
        assert (states.grads_resident - bucket) / GB == pytest.approx(grads_gb)


def test_seed_7b_fp32_breakdown_matches_optimizer_accounting() -> None:
    """The seed's 7B fp32 figure: 28 GB weights + 28 GB grads + 56 GB AdamW states = 112 GB."""
    facts = facts_with(7_000_000_000)
    states = model_states(Config(precision="fp32", optimizer="adamw"), facts, 1, "cuda")
    assert states.params / GB == pytest.approx(28.0)
    assert states.grads_step / GB == pytest.approx(28.0)
    assert states.optimizer / GB == pytest.approx(56.0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_states_fall_with_world_size(stage: int) -> None:
    """Optimizer states (and master copy) are divided over the data-parallel ranks from stage 1 on."""
    facts = facts_with(1_000_000_000)
    one = model_states(Config(precision="bf16", zero_stage=stage), facts, 1, "cuda")
    eight = model_states(Config(precision="bf16", zero_stage=stage), facts, 8, "cuda")
    assert eight.optimizer == pytest.approx(one.optimizer / 8)
    assert eight.master == pytest.approx(one.master / 8)
    assert (eight.params < one.params) == (stage == 3)


@pytest.mark.parametrize(
    ("optimizer", "bytes_per_param"),
    [("adamw", 8.0), ("lion", 4.0), ("sgd", 4.0), ("adamw8bit", 2.0 + 8 / 256)],
)
def test_optimizer_state_bytes_per_parameter(optimizer: str, bytes_per_param: float) -> None:
    facts = facts_with(10_000_000)
    assert optimizer_state_bytes(optimizer, facts, 1e7) / 1e7 == pytest.approx(bytes_per_param)


def test_adafactor_is_factored_unless_flat() -> None:
    facts = facts_with(10_000_000)
    assert optimizer_state_bytes("adafactor", facts, 1e7) == pytest.approx(4 * facts.factored_state_numel)
    assert optimizer_state_bytes("adafactor", facts, 1e7, flat=True) == pytest.approx(4e7)


def test_activation_memory_grows_with_micro_batch_and_falls_with_checkpointing() -> None:
    facts, hw = facts_with(1_000_000, act_per_sample=50_000_000), get_hardware("a100-80gb")
    small = predict(Config(micro_batch_size=2), facts, hw)
    large = predict(Config(micro_batch_size=16), facts, hw)
    ckpt = predict(Config(micro_batch_size=16, checkpoint_ratio=1.0), facts, hw)
    half = predict(Config(micro_batch_size=16, checkpoint_ratio=0.5), facts, hw)
    assert small.breakdown.activations < large.breakdown.activations
    assert ckpt.breakdown.activations < half.breakdown.activations < large.breakdown.activations
    assert ckpt.step_time_s > large.step_time_s  # recompute costs time


def test_breakdown_sums_to_peak_and_fits_is_against_budget() -> None:
    facts = facts_with(100_000_000)
    hw = get_hardware("cpu", memory_bytes=2**30)
    prediction = predict(Config(micro_batch_size=4), facts, hw)
    b = prediction.breakdown
    assert b.params + b.grads + b.optimizer + b.activations + b.other == prediction.peak_bytes
    assert prediction.fits == (prediction.peak_bytes <= 2**30)
    if not prediction.fits:
        assert prediction.reason and "needs" in prediction.reason


def test_slower_calibrated_dtype_predicts_slower_steps() -> None:
    facts, hw = facts_with(1_000_000), get_hardware("cpu")
    base = Coefficients.for_hardware(hw)
    slow_bf16 = base.with_(compute_efficiency=base.compute_efficiency | {"bf16": 0.01})
    fp32 = predict(Config(precision="fp32"), facts, hw, coefficients=slow_bf16)
    bf16 = predict(Config(precision="bf16"), facts, hw, coefficients=slow_bf16)
    assert bf16.step_time_s > 10 * fp32.step_time_s


def test_zero3_communication_exceeds_data_parallel() -> None:
    """ZeRO paper sec. 7: 2 Psi for data parallelism, 3 Psi for P_os+g+p (with nothing overlapped and no per-call
    latency, the volumes alone)."""
    facts, hw = facts_with(1_000_000_000), get_hardware("h100-80gb")
    serial = Coefficients.for_hardware(hw).with_(overlap_efficiency=0.0, collective_latency_s=0.0)
    dp = predict(Config(precision="bf16", zero_stage=1), facts, hw, world_size=8, coefficients=serial)
    z3 = predict(Config(precision="bf16", zero_stage=3), facts, hw, world_size=8, coefficients=serial)
    assert z3.time_breakdown["communication"] == pytest.approx(1.5 * dp.time_breakdown["communication"])


def test_cost_model_imports_without_torch() -> None:
    """Convention 1: the cost model is pure; importing it must not import torch."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import autofit.cost_model, autofit.planning.estimate, autofit.core.space, autofit.core.hardware\n"
        "assert sys.modules['torch'] is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_partial_checkpoint_trace_bends_the_interpolation() -> None:
    """Layers are not alike: with a trace at half the layers checkpointed, the quarter and three
    quarters points follow it (piecewise-linear), not the straight line between none and all."""
    from dataclasses import replace

    from autofit.trace import middle_checkpointed_layers

    facts = facts_with(10**6, n_layers=8)
    full = facts.profile("fp32", "sdpa", False)
    ckpt = facts.profile("fp32", "sdpa", True)
    attr = "peak_without_grads_bytes"

    def at(f: ModelFacts, n: int) -> float:
        return f.at_checkpointed("fp32", "sdpa", n, 2, attr)

    # no partial trace: a straight line
    assert at(facts, 4) == pytest.approx((full.at(2, attr) + ckpt.at(2, attr)) / 2)
    # the first half of the layers holds most of the activations: checkpointing it saves 90% of the saving
    def mostly_saved(f: PeakPoint, c: PeakPoint) -> int:
        return int(f.peak_without_grads_bytes - 0.9 * (f.peak_without_grads_bytes - c.peak_without_grads_bytes))

    half_points = tuple(
        replace(f, peak_without_grads_bytes=mostly_saved(f, c))
        for f, c in zip(full.points, ckpt.points, strict=True)
    )
    half = ActivationProfile(dtype="fp32", attention="sdpa", checkpointed=True, points=half_points)
    bent = replace(facts, profiles=facts.profiles | {ActivationProfile.partial_key("fp32", "sdpa", 4): half})
    assert at(bent, 4) == pytest.approx(half.at(2, attr))
    assert at(bent, 2) == pytest.approx((full.at(2, attr) + half.at(2, attr)) / 2)
    assert at(bent, 6) == pytest.approx((half.at(2, attr) + ckpt.at(2, attr)) / 2)
    assert at(bent, 0) == full.at(2, attr) and at(bent, 8) == ckpt.at(2, attr)
    # which ratio of a space is traced: the one nearest half that wraps some but not all layers
    assert middle_checkpointed_layers((0.0, 0.25, 0.5, 0.75, 1.0), 8) == 4
    assert middle_checkpointed_layers((0.0, 1.0), 8) == 0
    assert middle_checkpointed_layers((0.0, 0.5, 1.0), 1) == 0


def test_two_facts_never_share_a_memoized_value() -> None:
    """``at_checkpointed`` is memoized on its facts: facts made from others (``replace``) or alike but apart answer
    their own, each what facts never asked before answer, and the memo is no part of the facts' value or JSON."""
    from dataclasses import replace

    questions = [(dtype, n, mb, attr) for dtype in ("fp32", "bf16") for n in (0, 3, 8) for mb in (1, 3, 8)
                 for attr in ("peak_without_grads_bytes", "flops")]

    def answers(f: ModelFacts) -> list[float]:
        return [f.at_checkpointed(dtype, "sdpa", n, mb, attr) for dtype, n, mb, attr in questions]

    small, large = facts_with(10**6, n_layers=8), facts_with(10**6, n_layers=8, act_per_sample=5000)
    first = answers(small)
    assert answers(replace(small, profiles=large.profiles)) == answers(facts_with(10**6, n_layers=8,
                                                                                  act_per_sample=5000))
    assert answers(large) != first
    assert answers(small) == first == answers(facts_with(10**6, n_layers=8))
    assert small == facts_with(10**6, n_layers=8)
    assert small.to_dict() == facts_with(10**6, n_layers=8).to_dict()


def test_accumulating_zero1_and_zero2_hold_the_gradients_as_zero0_does() -> None:
    """Under accumulation the first micro-batch's gradients live through the next ones: autograd's .grad under
    ZeRO 0/1, ZeRO-2's grads_in_partition (the Qwen2-shaped model at mb2x8 fp32 ZeRO-1/2 was predicted 1.07 GiB
    and ran past 1.2 GiB before this). On one rank the partition is the whole model, so each holds ZeRO-0's
    bytes; on two ranks ZeRO-2 holds half of them."""
    from toy_facts import CPU, FACTS

    from autofit.cost_model.memory import accumulated_grad_bytes

    held = {z: accumulated_grad_bytes(Config(grad_accum_steps=4, zero_stage=z), FACTS, 1) for z in (0, 1, 2, 3)}
    assert held[0] == held[1] == held[2] == 4 * FACTS.n_trainable_params and held[3] == 0
    assert accumulated_grad_bytes(Config(grad_accum_steps=4, zero_stage=2), FACTS, 2) == held[2] / 2
    for stage in (1, 2):
        one = predict(Config(micro_batch_size=8, zero_stage=stage), FACTS, CPU, 1).breakdown
        four = predict(Config(micro_batch_size=8, grad_accum_steps=4, zero_stage=stage), FACTS, CPU, 1).breakdown
        assert four.grads >= one.grads + held[stage] or four.total >= one.total + held[stage]


def test_compile_adds_the_compilers_resident_memory_on_a_cpu_device_only() -> None:
    from autofit.cost_model.memory import COMPILED_CPU_RUNTIME_BYTES, COMPILED_CPU_RUNTIME_BYTES_ZERO3
    from autofit.cost_model.memory_correction import family

    facts, coefficients = facts_with(10**6), Coefficients()
    for name, extra in (("cpu", COMPILED_CPU_RUNTIME_BYTES), ("h100-80gb", 0)):
        hardware = get_hardware(name) if name != "cpu" else get_hardware("cpu", memory_bytes=8 * 2**30)
        eager = predict(Config(micro_batch_size=2), facts, hardware, 1, coefficients)
        compiled = predict(Config(micro_batch_size=2, compile="on"), facts, hardware, 1, coefficients)
        assert compiled.peak_bytes - eager.peak_bytes == extra
        assert compiled.step_time_s == eager.step_time_s  # fp32: nothing of its step is priced differently
    cpu = get_hardware("cpu", memory_bytes=8 * 2**30)
    zero3 = [predict(Config(zero_stage=3, compile=c), facts, cpu, 1, coefficients).peak_bytes for c in ("off", "on")]
    assert zero3[1] - zero3[0] == COMPILED_CPU_RUNTIME_BYTES_ZERO3 > COMPILED_CPU_RUNTIME_BYTES
    # the search's memory correction learns the compiled family apart
    assert family(Config(compile="on")) != family(Config())


def test_each_reduce_bucket_is_priced_in_memory():
    """ZeRO 1/2: one bucket of hidden^2 elements with contiguous_gradients, two with overlap_comm, none without
    contiguous_gradients, bucket_scale times larger; ZeRO-3 keeps one whatever overlap_comm (stage3.py)."""
    from dataclasses import replace

    from tests.toy_facts import FACTS

    facts = replace(FACTS, hidden_size=512)
    h100 = get_hardware("h100-80gb")

    def grads(**keys):
        return model_states(Config(precision="bf16", **keys), facts, 8, "cuda").grads_resident

    bucket = 2 * 512 * 512  # bf16 elements of one hidden x hidden bucket
    assert grads(zero_stage=2) == bucket
    assert grads(zero_stage=2, overlap_comm=True) == 2 * bucket
    assert grads(zero_stage=2, bucket_scale=4) == 4 * bucket
    assert grads(zero_stage=2, contiguous_gradients=False) == 0
    assert grads(zero_stage=3, overlap_comm=True) == grads(zero_stage=3)
    assert grads(zero_stage=3, bucket_scale=4) - grads(zero_stage=3) == 3 * bucket
    more = predict(Config(precision="bf16", zero_stage=2, overlap_comm=True), facts, h100, 8).peak_bytes
    assert more > predict(Config(precision="bf16", zero_stage=2), facts, h100, 8).peak_bytes


def _with_memory_bound_bytes(facts: ModelFacts, bytes_per_sample: int) -> ModelFacts:
    """``facts`` whose every traced point also reads and writes ``bytes_per_sample`` in non-matmul kernels."""
    from dataclasses import replace

    profiles = {key: replace(p, points=tuple(replace(pt, memory_bound_bytes=pt.micro_batch_size * bytes_per_sample)
                                             for pt in p.points))
                for key, p in facts.profiles.items()}
    return replace(facts, profiles=profiles)


def test_a_cuda_step_prices_its_memory_bound_kernels_at_the_devices_bandwidth() -> None:
    """The roofline's memory side: more non-matmul bytes, a longer step on a GPU, longer where the bandwidth is
    lower for its FLOP/s; a CPU folds them into its efficiency (its small activations stay in cache)."""
    config = Config(micro_batch_size=4, checkpoint_ratio=0.0, precision="bf16", optimizer="adamw", zero_stage=0)
    plain = facts_with(10**8, flops_per_sample=10**12)
    heavy = _with_memory_bound_bytes(plain, 10**9)

    def step(facts: ModelFacts, name: str) -> float:
        hardware = get_hardware(name)
        return predict(config, facts, hardware, 1, Coefficients.for_hardware(hardware)).time_breakdown["compute"]

    h100, a100 = (step(heavy, n) / step(plain, n) for n in ("h100-80gb", "a100-80gb"))
    assert h100 > a100 > 1.0  # an H100 has 3.2x an A100's bf16 FLOP/s, 1.6x its bandwidth
    cpu = get_hardware("cpu")
    cpu_config = config.with_(precision="fp32")
    assert (predict(cpu_config, heavy, cpu, 1, Coefficients.for_hardware(cpu)).step_time_s
            == predict(cpu_config, plain, cpu, 1, Coefficients.for_hardware(cpu)).step_time_s)



def test_compile_prices_the_fused_bytes_of_the_non_matmul_kernels() -> None:
    config = Config(micro_batch_size=4, checkpoint_ratio=0.0, precision="bf16", optimizer="adamw", zero_stage=0)
    facts = _with_memory_bound_bytes(facts_with(10**8, flops_per_sample=10**12), 10**9)
    from dataclasses import replace

    fused = replace(facts, profiles={key: replace(p, points=tuple(
        replace(pt, fused_memory_bound_bytes=pt.memory_bound_bytes // 4) for pt in p.points))
        for key, p in facts.profiles.items()})
    hardware = get_hardware("h100-80gb")
    prior = Coefficients.for_hardware(hardware)
    eager_s = predict(config, fused, hardware, 1, prior).time_breakdown["compute"]
    compiled_s = predict(config.with_(compile="on"), fused, hardware, 1, prior).time_breakdown["compute"]
    matmul_only_s = predict(config, facts_with(10**8, flops_per_sample=10**12), hardware, 1, prior).time_breakdown["compute"]
    assert matmul_only_s < compiled_s < eager_s
    assert (eager_s - matmul_only_s) == pytest.approx(4 * (compiled_s - matmul_only_s))
