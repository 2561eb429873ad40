"""Multi-node probes through PyTorch's elastic launcher: one ``torch.distributed.run`` agent per node.

Each agent joins a c10d rendezvous (``--rdzv-backend=c10d``, a TCPStore at ``--rdzv-endpoint``),
the agents agree on the world (``--nnodes`` x ``--nproc-per-node``) and each starts its node's
workers (:mod:`autofit.probe.worker`) with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (torch/distributed/run.py, elastic/agent/server/local_elastic_agent.py). On one
machine ``--nodes N`` starts N agents over loopback, the first hosting the store. On a Slurm
cluster the same agent command runs once per node under ``srun`` (README, "Several nodes")::

    srun --nodes=$NODES --ntasks-per-node=1 python -m torch.distributed.run \\
        --nnodes=$NODES --nproc-per-node=$GPUS --rdzv-backend=c10d \\
        --rdzv-endpoint=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):29500 \\
        --rdzv-id=$SLURM_JOB_ID -m autofit.probe.worker spec.json

Workers run in sessions of their own (the agent's subprocess handler) and ask the kernel to kill
them when their agent dies (:func:`autofit.probe.worker._die_with_parent`), so killing an agent's
session ends its node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from autofit.errors import AutofitError
from autofit.probe.launch import FAILURE_GRACE_S, RankOutcome, _tail, free_port, kill_group, rank_env
from autofit.probe.rank import read_rank_result


def agent_command(spec_path: Path, n_nodes: int, ranks_per_node: int, endpoint: str, run_id: str, is_host: bool) -> list[str]:
    """One node's ``torch.distributed.run`` command line (c10d rendezvous, no restarts: a probe fails once)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={n_nodes}", f"--nproc-per-node={ranks_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf=is_host={int(is_host)}", "--max-restarts=0", "--monitor-interval=0.5",
        "-m", "autofit.probe.worker", str(spec_path),
    ]  # fmt: skip


def agent_env(base: dict[str, str], world_size: int, kind: str) -> dict[str, str]:
    """An agent's environment: the workers' allocator, threading and import settings (the agent sets the ranks)."""
    env = rank_env(base, 0, world_size, 0, kind)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    return env


def check_devices(kind: str, ranks_per_node: int, visible: int | None) -> None:
    """One line when a node is asked for more ranks than it has CUDA devices (``visible``: None when unknown)."""
    if kind == "cuda" and visible is not None and ranks_per_node > visible:
        raise AutofitError(f"--gpus {ranks_per_node} ranks per node, but this node has {visible} CUDA device(s)")


def launch_agents(
    spec: dict[str, Any], workdir: Path, n_nodes: int, ranks_per_node: int, timeout_s: float
) -> tuple[list[RankOutcome], bool]:
    """Run the probe as ``n_nodes`` elastic agents on this machine; each rank's outcome and whether the deadline passed."""
    spec_path = workdir / "spec.json"
    world_size = n_nodes * ranks_per_node
    spec = dict(spec, result_dir=str(workdir), spawn_time=time.time())
    spec_path.write_text(json.dumps(spec))
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:12]
    agents: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for node in range(n_nodes):
            logs.append(open(workdir / f"agent{node}.log", "wb"))
            command = agent_command(spec_path, n_nodes, ranks_per_node, endpoint, run_id, is_host=node == 0)
            agents.append(
                subprocess.Popen(command, env=agent_env(dict(os.environ), world_size, spec["kind"]), stdin=subprocess.DEVNULL,
                                 stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True, cwd=os.getcwd())
            )
        timed_out = _wait_agents(agents, workdir, world_size, time.monotonic() + timeout_s)
    finally:
        for agent in agents:
            kill_group(agent)
        for log in logs:
            log.close()
    return [_rank_outcome(workdir, rank, ranks_per_node, agents) for rank in range(world_size)], timed_out


def _rank_outcome(workdir: Path, rank: int, ranks_per_node: int, agents: list[subprocess.Popen[bytes]]) -> RankOutcome:
    """A rank's result file; its log is its node's agent log (c10d may number the nodes in any order)."""
    result = read_rank_result(workdir / f"rank{rank}.json", rank)
    node = rank // ranks_per_node
    return RankOutcome(rank, agents[node].returncode, result, _tail(workdir / f"agent{node}.log"), pid=agents[node].pid)


def _wait_agents(agents: list[subprocess.Popen[bytes]], workdir: Path, world_size: int, deadline: float) -> bool:
    """Wait until every agent exits; stop a grace period after a rank reports a failure. True on the deadline."""
    failed_at: float | None = None
    while any(agent.poll() is None for agent in agents):
        now = time.monotonic()
        if now > deadline:
            return True
        if failed_at is None and any(_failed(workdir / f"rank{r}.json", r) for r in range(world_size)):
            failed_at = now
        if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
            return False
        time.sleep(0.1)
    return False


def _failed(path: Path, rank: int) -> bool:
    result = read_rank_result(path, rank)
    return result is not None and result.status != "ok"
