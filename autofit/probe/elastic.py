"""Multi-node probes through PyTorch's elastic launcher: one agent per node, a c10d rendezvous.

Each node runs :mod:`autofit.probe.rank.agent` (``torch.distributed.launcher.api.elastic_launch``, what
``torchrun`` runs), started as :func:`autofit.probe.nodes.plan_nodes` says: one ``srun`` step of one task
per node on a Slurm allocation, ``ssh`` to each of ``--hosts``, or N agents on this machine (simulated nodes,
each with its own slice of the GPUs). The agents agree on the world (``--nnodes`` x ``--nproc-per-node``)
at the rendezvous store on the first node and each starts its node's ranks with RANK, LOCAL_RANK (0..G-1 on
every node), WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (torch/distributed/elastic/agent/server/api.py).

This process gives each agent the spec on its stdin and reads its ranks' results from its stdout (no
filesystem shared between nodes); it closes the agents' stdin to end them (they end their ranks), and kills
the process groups it started when they do not go. A Slurm step ends when srun does.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autofit.core.errors import AutofitError
from autofit.machine.nvml import visible_cuda_device_list
from autofit.probe.launch import RankOutcome, _tail, free_port, kill_group, wait_for_ranks, with_package_root
from autofit.probe.nodes import NodeLaunch, plan_nodes
from autofit.probe.rank.agent import parse_record
from autofit.probe.records import ProbeSpec, RankResult


def check_devices(kind: str, ranks_per_node: int, visible: int | None) -> None:
    """One line when a node is asked for more ranks than it has CUDA devices (``visible``: None when unknown)."""
    if kind == "cuda" and visible is not None and ranks_per_node > visible:
        raise AutofitError(f"--gpus {ranks_per_node} ranks per node, but this node has {visible} CUDA device(s)")


def node_launch(kind: str, n_nodes: int, ranks_per_node: int, hosts: tuple[str, ...] = ()) -> NodeLaunch:
    """:func:`autofit.probe.nodes.plan_nodes` for this machine: its environment, GPUs, host name and tools."""


    environ = dict(os.environ, PYTHONPATH=with_package_root(os.environ.get("PYTHONPATH")))  # for the agents
    return plan_nodes(kind, n_nodes, ranks_per_node, environ=environ, hosts=hosts,
                      visible_devices=visible_cuda_device_list() if kind == "cuda" else None, python=sys.executable,
                      cwd=os.getcwd(), port=free_port(), run_id=uuid.uuid4().hex[:12], this_host=socket.gethostname(),
                      which=shutil.which)


@dataclass
class _Agent:
    """One started agent (or srun/ssh): its process, the records its stdout brought and the rest as log."""

    proc: subprocess.Popen[bytes]
    log: Any
    results: dict[int, RankResult] = field(default_factory=dict)
    exits: dict[int, dict[str, Any]] = field(default_factory=dict)
    reader: threading.Thread | None = None

    def read(self) -> None:

        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace")
            record = parse_record(line)
            if record is None:
                self.log.write(raw)
                continue
            name, data = record
            rank = int(data.get("rank", -1))
            if name == "result":
                self.results[rank] = _rank_result(data, rank)
            else:
                self.exits[rank] = data
                if data.get("result") is not None:
                    self.results[rank] = _rank_result(data["result"], rank)
        self.log.flush()


def _rank_result(data: dict[str, Any], rank: int) -> RankResult:
    try:
        return RankResult.from_json(data)
    except AutofitError as exc:
        return RankResult(rank=max(rank, 0), status="error", message=f"rank {rank} sent an unreadable result: {exc}"[:500])


def launch_agents(spec: ProbeSpec, workdir: Path, launch: NodeLaunch, world_size: int,
                  timeout_s: float) -> tuple[list[RankOutcome], bool]:
    """Run the probe through ``launch``'s agents; each rank's outcome and whether the deadline passed."""
    line = (json.dumps(spec.launched().to_json()) + "\n").encode()
    agents: list[_Agent] = []
    try:
        for index, command in enumerate(launch.commands):
            log = open(workdir / f"agent{index}.log", "wb")
            proc = subprocess.Popen(command.argv, env={**os.environ, **command.env}, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=os.getcwd())
            agent = _Agent(proc, log)
            agents.append(agent)
            agent.reader = threading.Thread(target=agent.read, name=f"autofit-agent{index}", daemon=True)
            agent.reader.start()
            assert proc.stdin is not None
            proc.stdin.write(line)
            proc.stdin.flush()
        # an agent has failed once one of its ranks reported a result other than ok
        timed_out = wait_for_ranks([agent.proc for agent in agents], time.monotonic() + timeout_s,
                                   lambda index, _code: any(r.status != "ok" for r in agents[index].results.values()))
    finally:
        _stop(agents)
    return [_rank_outcome(workdir, rank, agents) for rank in range(world_size)], timed_out


def _stop(agents: list[_Agent]) -> None:
    """Close the agents' stdin (each ends itself and its ranks), give them a moment, then kill what is left."""
    for agent in agents:
        try:
            assert agent.proc.stdin is not None
            agent.proc.stdin.close()
        except OSError:
            pass
    deadline = time.monotonic() + 5.0
    for agent in agents:
        try:
            agent.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        kill_group(agent.proc)
        if agent.reader is not None:
            agent.reader.join(timeout=5.0)
        agent.log.close()


def _rank_outcome(workdir: Path, rank: int, agents: list[_Agent]) -> RankOutcome:
    """A rank's result, from whichever agent sent it; its log: that agent's (every agent's when none did)."""
    owner = next((a for a in agents if rank in a.results or rank in a.exits), None)
    exit_info = owner.exits.get(rank, {}) if owner else {}
    logs = [owner] if owner else agents
    tail = "".join(_tail(workdir / f"agent{agents.index(a)}.log") for a in logs)[-4000:]
    returncode = exit_info.get("exitcode", owner.proc.returncode if owner else agents[0].proc.returncode)
    pid = int(exit_info.get("pid", (owner or agents[0]).proc.pid))
    return RankOutcome(rank, returncode, owner.results.get(rank) if owner else None, tail, pid=pid)

