"""The target's software (docs/design.md, "The target's software"): a plan for a preset is judged by the cluster's
software, not this machine's; a probe here is judged here; ``--software FILE`` states another machine's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from autofit.cli import main
from autofit.core.errors import AutofitError
from autofit.core.software import CUDA_CLUSTER, Software
from autofit.machine.software import detect_software, read_software_file
from autofit.planning.estimate import estimate
from autofit.planning.target import Target, prepare

ROOT = Path(__file__).resolve().parents[2]
MLP = f"{ROOT}/examples/mlp.py:workload"
GPT = f"{ROOT}/examples/gpt.py:workload"
#: narrows the default space to a few hundred candidates, keeping flash, compile and NVMe in it
NARROW = ("micro_batch_size=1", "checkpoint_granularity=block", "bucket_scale=1", "contiguous_gradients=true")


@pytest.mark.parametrize(
    ("values", "source"),
    [
        ({"hardware": "cpu"}, "here"),  # this machine is the device
        ({"hardware": "auto"}, "here"),
        ({"hardware": "h100-80gb"}, "cluster"),  # a preset: the machines that will train
        ({"hardware": "cpu", "nodes": 2, "hosts": "a,b"}, "cluster"),  # other hosts
        ({"hardware": "h100-80gb", "software": "here"}, "here"),  # said
    ],
)
def test_the_software_left_out_is_the_targets(values: dict[str, object], source: str) -> None:
    assert prepare(Target(entry=MLP, **values)).software.source == source  # type: ignore[arg-type]


def test_a_probe_here_is_judged_by_this_machines_software() -> None:
    setup = prepare(Target(entry=MLP, hardware="h100-80gb"), probes_here=True)
    assert setup.software == detect_software()
    with pytest.raises(AutofitError, match="--software cluster: this command probes on this machine"):
        prepare(Target(entry=MLP, hardware="h100-80gb", software="cluster"), probes_here=True)
    # on --hosts the probes run there: another machine's software is theirs to state
    remote = prepare(Target(entry=MLP, hardware="cpu", nodes=2, hosts="a,b", software="cluster"), probes_here=True)
    assert remote.software.source == "cluster"


def test_autofit_probe_refuses_another_machines_software_in_one_line() -> None:
    result = CliRunner().invoke(main, ["probe", MLP, "--hardware", "h100-80gb", "--software", "cluster"])
    assert result.exit_code == 1
    assert result.output.strip().startswith("autofit: error: --software cluster: this command probes on this machine")


def test_a_software_file_states_what_differs_from_the_cluster(tmp_path: Path) -> None:
    path = tmp_path / "target.json"
    path.write_text(json.dumps({"flash_attn": False, "prebuilt_ops": ["fused_adam"]}))
    software = read_software_file(str(path))
    assert software == replace(CUDA_CLUSTER, flash_attn=False, prebuilt_ops=frozenset({"fused_adam"}), source=str(path))
    assert Software.from_dict(software.to_dict(), Software(), str(path)) == software  # to_dict round-trips
    for text, message in (("[]", "must hold a JSON object"), ('{"flash": true}', "unknown software key 'flash'"),
                          ('{"triton": "yes"}', "triton must be true or false"), ("{", "is not JSON")):
        path.write_text(text)
        with pytest.raises(AutofitError, match=message):
            read_software_file(str(path))
    with pytest.raises(AutofitError, match="cannot be read"):
        read_software_file(str(tmp_path / "missing.json"))


def test_another_machines_nvme_path_is_not_checked_here_but_must_be_absolute() -> None:
    setup = prepare(Target(entry=MLP, hardware="h100-80gb", nvme_path="/mnt/nvme0"))
    assert setup.software.nvme_path == "/mnt/nvme0" and setup.software.nvme_free_bytes is None
    with pytest.raises(AutofitError, match="must be an absolute path"):
        prepare(Target(entry=MLP, hardware="h100-80gb", nvme_path="nvme"))


@pytest.mark.slow
def test_a_plan_for_a_preset_made_here_offers_what_the_cluster_runs_and_equals_the_same_profile_as_a_file(
        tmp_path: Path) -> None:
    target = Target(entry=GPT, hardware="h100-80gb", gpus=8, global_batch=8, nvme_path="/local_nvme",
                    set_values=NARROW)
    cluster = estimate(prepare(target).plan())
    offered = [c.config for c in cluster.candidates]
    assert {"flash", "sdpa"} <= {c.attention for c in offered}
    assert "on" in {c.compile for c in offered}
    assert "nvme" in {c.offload_params for c in offered} and "nvme" in {c.offload_optimizer for c in offered}
    document = cluster.to_dict()
    assert document["software"]["source"] == "cluster" and document["software"]["flash_attn"] is True
    assert all(c["deepspeed"]["autofit"]["software"]["source"] == "cluster" for c in document["candidates"]
               if c["fits"])

    profile = tmp_path / "cluster.json"
    profile.write_text(json.dumps(CUDA_CLUSTER.to_dict()))
    from_file = estimate(prepare(replace(target, software=str(profile))).plan())
    assert from_file.software is not None and from_file.software.source == str(profile)
    ranking = [(c.config, c.prediction) for c in cluster.candidates]
    assert ranking == [(c.config, c.prediction) for c in from_file.candidates]  # same candidates, same ranking
    assert cluster.rejected == from_file.rejected

    if not detect_software().flash_attn or not detect_software().triton:  # this machine's own plan lacks them
        here = estimate(prepare(replace(target, software="here", nvme_path=None)).plan())
        kinds = {(c.config.attention, c.config.compile) for c in here.candidates}
        assert ("flash", "on") not in kinds
