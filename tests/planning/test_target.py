"""The shared request and the setup made from it once: checked values, nothing passed through the environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autofit.core.errors import AutofitError
from autofit.planning.target import Target, prepare

ROOT = Path(__file__).resolve().parents[2]
MLP = f"{ROOT}/examples/mlp.py:workload"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gpus": 0}, "gpus must be an integer >= 1, but got gpus=0"),
        ({"nodes": True}, "nodes must be an integer >= 1"),
        ({"global_batch": 0}, "global_batch must be an integer >= 1 or None"),
        ({"set_values": "zero_stage=2"}, "set_values must be a tuple"),
    ],
)
def test_a_bad_value_names_its_field(values: dict[str, object], message: str) -> None:
    with pytest.raises(AutofitError, match=message):
        Target(entry=MLP, **values)  # type: ignore[arg-type]


@pytest.mark.slow
def test_prepare_resolves_the_request_once_and_writes_no_environment(tmp_path: Path) -> None:
    before = dict(os.environ)
    target = Target(entry=MLP, hardware="h100-80gb", memory="2GiB", gpus=2, nodes=2, global_batch=16,
                    set_values=("zero_stage=1",), nvme_path=str(tmp_path), software="here")
    setup = prepare(target)
    assert dict(os.environ) == before
    assert setup.hardware.memory_bytes == 2 * 2**30 and setup.hardware.devices_per_node == 2
    assert setup.world_size == 4 and setup.fixed == {"zero_stage": 1}
    assert setup.software.nvme_path == str(tmp_path.resolve())
    plan = setup.plan()
    assert plan.software == setup.software  # the rules and every JSON of the plan see --nvme-path
    assert {c.zero_stage for c in plan.candidates} == {1} and plan.world_size == 4


def test_prepare_refuses_an_nvme_path_that_is_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(AutofitError, match="--nvme-path .* is not an existing directory"):
        prepare(Target(entry=MLP, hardware="h100-80gb", nvme_path=str(tmp_path / "missing"), software="here"))


def test_memory_that_does_not_parse_is_one_error() -> None:
    with pytest.raises(AutofitError, match="cannot parse memory size 'lots'"):
        prepare(Target(entry=MLP, hardware="cpu", memory="lots"))


def test_gpus_left_out_are_resolved_once_by_prepare() -> None:
    target = Target(entry=MLP, hardware="h100-80gb")
    assert target.gpus is None
    with pytest.raises(AutofitError, match="gpus=None is resolved by autofit.planning.target.prepare"):
        _ = target.world_size
    setup = prepare(target)  # a preset plans for one device unless told more (autofit.core.hardware.default_gpus)
    assert setup.gpus == 1 and setup.target.gpus == 1 and setup.hardware.devices_per_node == 1
    assert setup.world_size == 1


def test_prepare_reads_hosts_once_and_wants_one_a_node(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-1 slots=8\nworker-2 slots=8\n")
    setup = prepare(Target(entry=MLP, hardware="cpu", nodes=2, hosts=str(hostfile)))
    hostfile.unlink()  # read once: the setup keeps what the file said
    assert setup.hosts == ("worker-1", "worker-2")
    assert prepare(Target(entry=MLP, hardware="cpu")).hosts == ()
    with pytest.raises(AutofitError, match="--hosts names 1 host\\(s\\) \\(onlyone\\) for --nodes 2; give one host per node"):
        prepare(Target(entry=MLP, hardware="cpu", nodes=2, hosts="onlyone"))
