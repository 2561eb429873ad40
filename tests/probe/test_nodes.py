"""Multi-node probes: where each node's agent runs (:mod:`autofit.probe.nodes`) and a real elastic run."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from autofit.core.config import Config
from autofit.core.errors import AutofitError
from autofit.machine.device import get_hardware
from autofit.probe.elastic import launch_agents, node_launch
from autofit.probe.launch import FAILURE_GRACE_S, with_package_root
from autofit.probe.nodes import NodeCommand, NodeLaunch, device_slices, expand_nodelist, plan_nodes, read_hosts, remote_command
from autofit.probe.rank.agent import RESULT_MARK, exit_records, parse_args, parse_record
from autofit.probe.records import RankResult
from autofit.probe.run import run_probe
from autofit.probe.spec import probe_spec

ENTRY = str(Path(__file__).with_name("probe_workloads.py"))
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_NNODES": "2", "PATH": "/usr/bin"}
EIGHT = [str(i) for i in range(8)]
#: what the fake agents read (one line on their stdin) and ignore
SPEC = probe_spec(f"{ENTRY}:tiny", Config(), get_hardware("cpu"), 2)


def _plan(kind: str = "cuda", n_nodes: int = 2, ranks_per_node: int = 8, *, environ: dict[str, str] | None = None,
          hosts: tuple[str, ...] = (), visible: list[str] | None = None, tools: tuple[str, ...] = ("srun", "ssh")):
    return plan_nodes(kind, n_nodes, ranks_per_node, environ=environ or {}, hosts=hosts, visible_devices=visible,
                      python="/opt/venv/bin/python", cwd="/home/u/proj", port=29511, run_id="abc123",
                      this_host="login-1", which=lambda tool: f"/usr/bin/{tool}" if tool in tools else None)


def test_a_slurm_allocation_runs_one_srun_task_per_node_with_a_c10d_rendezvous_on_its_first_node() -> None:
    launch = _plan(environ=SLURM, visible=EIGHT)
    assert launch.how == "slurm" and launch.endpoint == "gpu-07:29511"
    [command] = launch.commands
    srun = command.argv[:command.argv.index("/opt/venv/bin/python")]
    assert srun[0] == "srun" and {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--input=all"} <= set(srun)
    agent = parse_args(list(command.argv[len(srun) + 3:]))  # what the agent on each node reads
    assert command.argv[len(srun):len(srun) + 3] == ("/opt/venv/bin/python", "-m", "autofit.probe.rank.agent")
    assert (agent.nnodes, agent.nproc_per_node, agent.rdzv_endpoint, agent.rdzv_id) == (2, 8, "gpu-07:29511", "abc123")
    assert agent.ranks_on_host == 8 and agent.is_host is None  # torch picks the store's host by its name
    with pytest.raises(AutofitError, match="srun is not on PATH"):
        _plan(environ=SLURM, visible=EIGHT, tools=("ssh",))


def test_named_hosts_run_an_agent_each_through_ssh_and_this_machine_directly() -> None:
    environ = {"NCCL_IB_HCA": "mlx5", "PYTHONPATH": "/home/u/autofit", "CUDA_VISIBLE_DEVICES": "3", "SECRET": "x"}
    launch = _plan(environ=environ, hosts=("login-1", "node-b"))
    assert launch.how == "hosts" and launch.endpoint == "login-1:29511"
    local, remote = launch.commands
    assert parse_args(list(local.argv[3:])).is_host == 1
    assert remote.argv[:5] == ("ssh", "-o", "BatchMode=yes", "--", "node-b")  # "--": the host is no option
    words = shlex.split(remote.argv[5])
    assert words[:4] == ["cd", "/home/u/proj", "&&", "env"]
    assert "NCCL_IB_HCA=mlx5" in words and "PYTHONPATH=/home/u/autofit" in words
    assert not any(w.startswith(("SECRET=", "CUDA_VISIBLE_DEVICES=")) for w in words)
    agent = parse_args(words[words.index("autofit.probe.rank.agent") + 1:])
    assert (agent.nnodes, agent.nproc_per_node, agent.is_host, agent.rdzv_endpoint) == (2, 8, 0, "login-1:29511")
    # hosts win over the Slurm allocation; their number must be the nodes'
    assert _plan(environ=SLURM, hosts=("a", "b")).how == "hosts"
    with pytest.raises(AutofitError, match="names 3 host.*for --nodes 2"):
        _plan(hosts=("a", "b", "c"))
    with pytest.raises(AutofitError, match="needs ssh"):
        _plan(hosts=("a", "b"), tools=())


def test_a_loopback_name_beside_remote_hosts_is_refused_as_no_remote_node_reaches_it() -> None:
    """``localhost,nodeb`` would give nodeb the store at ``localhost``: nodeb's agent would wait for itself."""
    for hosts in (("localhost", "node-b"), ("127.0.0.1", "node-b"), ("node-b", "::1"), ("127.0.1.1", "node-b")):
        with pytest.raises(AutofitError) as refused:
            _plan("cpu", 2, 1, hosts=hosts)
        line = str(refused.value)
        assert "\n" not in line and "loopback" in line and "node-b" in line and "'login-1'" in line
    # every host this machine: the agents run here, no ssh, and the loopback store is right
    launch = _plan("cpu", 2, 1, hosts=("localhost", "login-1"), tools=())
    assert launch.endpoint == "localhost:29511" and [c.argv[0] for c in launch.commands] == ["/opt/venv/bin/python"] * 2
    # this machine by the name the others reach it by is the store's host
    assert _plan("cpu", 2, 1, hosts=("login-1", "node-b")).endpoint == "login-1:29511"


def test_the_remote_command_keeps_forwarded_values_whole_when_a_shell_runs_it(tmp_path: Path) -> None:
    """What ssh hands the remote shell, run by a real ``sh``: each forwarded value arrives as it was sent."""
    show = (sys.executable, "-c", "import os, sys; print(repr(os.environ.get('NCCL_X')), sys.argv[1:])", "a  env  b")
    environ = {"NCCL_X": "a  env  b", "PATH": os.environ["PATH"], "SECRET": "x"}
    command = remote_command(show, str(tmp_path), environ)
    seen = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True, env={}).stdout.strip()
    assert seen == "'a  env  b' ['a  env  b']"
    # nothing to forward: no bare env, the agent itself
    assert shlex.split(remote_command(show, "/p", {"SECRET": "x"})) == ["cd", "/p", "&&", *show]


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client here")
def test_real_ssh_reads_the_host_after_the_end_of_its_options() -> None:
    """OpenSSH ends its options at ``--`` (getopt): the argv autofit builds reaches the host lookup, and a name
    like ``-oProxyCommand=...`` after ``--`` is a host name (refused), never an option that runs a command."""
    launch = _plan("cpu", 2, 1, hosts=("login-1", "autofit-test-no-such-host.invalid"), environ={"PATH": "/usr/bin"})
    ssh = launch.commands[1].argv
    done = subprocess.run([*ssh[:3], "-o", "ConnectTimeout=5", *ssh[3:]], capture_output=True, text=True, timeout=60)
    assert done.returncode == 255 and "autofit-test-no-such-host.invalid" in done.stderr, done.stderr
    assert "illegal option" not in done.stderr and "usage" not in done.stderr


def test_simulated_nodes_get_disjoint_gpu_slices_and_need_all_their_gpus() -> None:
    launch = _plan(n_nodes=2, ranks_per_node=4, visible=EIGHT)
    assert launch.how == "local" and launch.endpoint == "127.0.0.1:29511"
    slices = [c.env["CUDA_VISIBLE_DEVICES"].split(",") for c in launch.commands]
    assert slices == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    assert [parse_args(list(c.argv[3:])).is_host for c in launch.commands] == [1, 0]
    assert parse_args(list(launch.commands[0].argv[3:])).ranks_on_host == 8  # both nodes share these cores
    uuids = [f"GPU-{uuid.uuid4()}" for _ in range(4)]
    assert device_slices(uuids, 2, 2) == [",".join(uuids[:2]), ",".join(uuids[2:])]
    # a one-node allocation asked for two nodes falls back to slices of its GPUs
    one_node = dict(SLURM, SLURM_JOB_NODELIST="gpu-07", SLURM_NNODES="1")
    assert _plan(n_nodes=2, ranks_per_node=4, environ=one_node, visible=EIGHT).how == "local"
    # the CPU simulates nodes over loopback without devices; every agent imports the same autofit
    assert [c.env for c in _plan("cpu", 2, 1).commands] == [{}, {}]
    assert [c.env for c in _plan("cpu", 2, 1, environ={"PYTHONPATH": "/src/autofit"}).commands] == [
        {"PYTHONPATH": "/src/autofit"}] * 2


def test_nodes_that_cannot_be_placed_are_one_line_and_no_probe() -> None:
    with pytest.raises(AutofitError) as refused:
        _plan(n_nodes=2, ranks_per_node=8, visible=EIGHT)
    line = str(refused.value)
    assert "\n" not in line and "16 GPUs (8 visible)" in line and "--hosts" in line and "autofit estimate" in line
    with pytest.raises(AutofitError, match="an unknown number of visible"):
        _plan(visible=None)


def test_run_probe_refuses_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    for key in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(key, raising=False)
    h100 = dataclasses.replace(get_hardware("h100-80gb"), devices_per_node=1)
    with pytest.raises(AutofitError, match="2 GPUs \\(1 visible\\)"):
        run_probe(probe_spec(f"{ENTRY}:tiny", Config(), h100, world_size=2, steps=1), timeout_s=5)


def test_slurm_host_lists_and_hostfiles(tmp_path: Path) -> None:
    assert expand_nodelist("gpu-[01-03,7],login1") == ["gpu-01", "gpu-02", "gpu-03", "gpu-7", "login1"]
    assert expand_nodelist("node[8-10]-ib") == ["node8-ib", "node9-ib", "node10-ib"]
    with pytest.raises(AutofitError, match="cannot read the Slurm host list"):
        expand_nodelist("gpu-[a-b]")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# DeepSpeed's format\nworker-1 slots=8\n\nworker-2 slots=8  # second\n")
    assert read_hosts(str(hostfile)) == ("worker-1", "worker-2")
    assert read_hosts("a, b") == ("a", "b")
    with pytest.raises(AutofitError, match="names no host"):
        read_hosts(" , ")


def test_a_host_name_ssh_would_misread_and_a_hostfile_that_is_not_text_are_one_line_each(tmp_path: Path) -> None:
    for value in ("-oProxyCommand=touch /tmp/x,b", "a b,c", "a\tb", "a\x1b,b"):
        with pytest.raises(AutofitError, match="is not a host name") as refused:
            read_hosts(value)
        assert "\n" not in str(refused.value)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("-oProxyCommand=touch /tmp/x slots=8\nworker-2\n")
    with pytest.raises(AutofitError, match="'-oProxyCommand=touch' is not a host name"):
        read_hosts(str(hostfile))
    binary = tmp_path / "hosts.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe\x00\x80")
    with pytest.raises(AutofitError) as unreadable:
        read_hosts(str(binary))
    assert str(binary) in str(unreadable.value) and "UnicodeDecodeError" in str(unreadable.value)
    assert "\n" not in str(unreadable.value)


def test_agents_get_this_autofit_first_on_their_path_once_and_their_ranks_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's ranks' environment (training_env) is built from the agent's: the root is not added twice."""
    from autofit.probe.launch import training_env

    root = str(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/x", root, "/y"]))
    for key in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(key, raising=False)
    agents = node_launch("cpu", 2, 1).commands
    assert [c.env["PYTHONPATH"].split(os.pathsep) for c in agents] == [[root, "/x", "/y"]] * 2
    ranks = training_env(dict(agents[0].env), "cpu", 1, 2)
    assert ranks["PYTHONPATH"].split(os.pathsep) == [root, "/x", "/y"]
    assert with_package_root(None) == with_package_root("") == root


def _fake_agent(record: RankResult | None, then: str) -> NodeCommand:
    """A process that reads the spec line as an agent does, sends ``record`` as a rank's result, then exits
    (``then`` "exit") or waits for its stdin to close (``then`` "wait"), as a real agent does."""
    line = "" if record is None else RESULT_MARK + json.dumps(record.to_json())
    code = ("import sys; sys.stdin.readline(); print(sys.argv[1], flush=True); "
            + ("sys.stdin.read()" if then == "wait" else "pass"))
    return NodeCommand((sys.executable, "-c", code, line))


def test_agents_that_finish_are_read_and_ones_past_the_deadline_are_stopped(tmp_path: Path) -> None:
    done = NodeLaunch("local", (_fake_agent(RankResult(0, "ok"), "exit"), _fake_agent(RankResult(1, "ok"), "exit")), "")
    outcomes, timed_out = launch_agents(SPEC, tmp_path, done, 2, timeout_s=60)
    assert not timed_out and [o.result.status if o.result else None for o in outcomes] == ["ok", "ok"]
    stuck = NodeLaunch("local", (_fake_agent(None, "wait"), _fake_agent(None, "wait")), "")
    t0 = time.monotonic()
    outcomes, timed_out = launch_agents(SPEC, tmp_path, stuck, 2, timeout_s=0.5)
    assert timed_out and [o.result for o in outcomes] == [None, None] and time.monotonic() - t0 < FAILURE_GRACE_S


@pytest.mark.slow
def test_a_rank_that_failed_on_one_agent_ends_the_probe_after_the_grace_not_the_deadline(tmp_path: Path) -> None:
    """Agent 1's rank reports an error while agent 0 waits (its rank in a collective): the wait ends
    FAILURE_GRACE_S later, not at the deadline, and rank 1's error is kept."""
    failing = RankResult(1, "error", message="boom")
    launch = NodeLaunch("local", (_fake_agent(None, "wait"), _fake_agent(failing, "wait")), "")
    t0 = time.monotonic()
    outcomes, timed_out = launch_agents(SPEC, tmp_path, launch, 2, timeout_s=120)
    took = time.monotonic() - t0
    assert not timed_out and FAILURE_GRACE_S <= took < FAILURE_GRACE_S + 10
    assert outcomes[1].result == failing and outcomes[0].result is None


def test_the_agent_reports_a_rank_the_oom_killer_ended_from_torchs_process_failure(tmp_path: Path) -> None:
    """A real process ended by SIGKILL, as torch's elastic agent reports it (``ProcessFailure``), with the
    node's memory cgroup counter risen between the start and the end: a host ``oom``; without the rise, its
    exit code only."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from autofit.probe.oom_killer import cgroup_oom_kills

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=20)
    group = tmp_path / "job"
    group.mkdir()
    self_cgroup = tmp_path / "self"
    self_cgroup.write_text("0::/job\n")
    (group / "memory.events").write_text("oom 0\noom_kill 0\n")
    before = cgroup_oom_kills(tmp_path, self_cgroup)
    (group / "memory.events").write_text("oom 1\noom_kill 1\n")
    after = cgroup_oom_kills(tmp_path, self_cgroup)
    failures = {1: ProcessFailure(local_rank=0, pid=proc.pid, exitcode=proc.returncode, error_file="<N/A>"),
                0: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file="<N/A>")}
    [record] = exit_records(failures, {0}, "", before, after)  # rank 0 wrote its own result
    assert (record["rank"], record["exitcode"], record["pid"]) == (1, -9, proc.pid)
    assert (record["result"]["status"], record["result"]["oom_on"]) == ("oom", "host")
    [plain] = exit_records(failures, {0}, "", after, after)
    assert plain["result"] is None and plain["exitcode"] == -9
    line = f"partial output without newline{RESULT_MARK}" + '{"rank": 3, "status": "ok"}'
    assert parse_record(line) == ("result", {"rank": 3, "status": "ok"})


def _memory_cgroup(limit_bytes: int) -> Path | None:
    group = Path("/sys/fs/cgroup/memory") / f"autofit-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    except OSError:
        return None
    return group


@pytest.mark.slow
def test_two_simulated_nodes_mark_the_rank_the_oom_killer_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 nodes x 1 rank through the elastic agents (c10d on loopback, gloo); rank 1 is ended by the kernel's
    OOM killer inside a 64 MiB memory cgroup: the probe is ``oom`` on the host, not an error."""
    group = _memory_cgroup(64 * 2**20)
    if group is None:
        pytest.skip("cannot create a memory cgroup here (needs root and cgroup v1)")
    monkeypatch.setenv("AUTOFIT_TEST_CGROUP", str(group))
    monkeypatch.setenv("AUTOFIT_TEST_OOM_RANK", "1")
    cpu = dataclasses.replace(get_hardware("cpu"), devices_per_node=1)
    config = Config(zero_stage=2, optimizer="adamw", precision="fp32", micro_batch_size=2)
    try:
        result = run_probe(probe_spec(f"{ENTRY}:host_hog", config, cpu, world_size=2, steps=1, warmup_steps=0), timeout_s=240)
    finally:
        group.rmdir()
    assert (result.status, result.oom_on) == ("oom", "host"), result.message
    assert "OOM killer" in (result.message or "")
    assert result.launcher == "torch.distributed.run"


@pytest.mark.slow
def test_autofit_probe_and_run_refuse_unplaceable_nodes_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from autofit.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    for key in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    shared = [f"{ENTRY}:tiny", "--hardware", "h100-80gb", "--gpus", "1", "--nodes", "2"]
    for argv in (["probe", *shared], ["run", *shared, "--trials", "1"]):
        done = CliRunner().invoke(main, argv)
        assert done.exit_code == 1, done.output
        assert done.output.strip().count("\n") == 0 and "2 GPUs (1 visible)" in done.output
    assert not list(tmp_path.iterdir())  # no study, no JSON: nothing half-written
