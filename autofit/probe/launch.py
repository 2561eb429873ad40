"""Start the ranks of one probe as subprocesses, wait with a deadline, and collect their results.

No launcher (no ``deepspeed`` CLI, pdsh or ssh): ``world_size`` copies of
:mod:`autofit.probe.rank.worker` are started here with the environment
``torch.distributed`` reads (MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK,
LOCAL_RANK, WORLD_SIZE). Each rank leads its own session (process group), so a
timeout or an early failure kills everything it started, and every rank asks
the kernel to kill it if this process dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from autofit.core.software import deepspeed_arch_list
from autofit.core.storage_url import without_secrets
from autofit.probe.failure import classify_exit, ended_by_sigkill, read_kernel_log
from autofit.probe.oom_killer import oom_kills
from autofit.probe.records import ProbeSpec, RankResult, read_rank_result

if TYPE_CHECKING:
    from autofit.probe.warm import WarmParent

#: seconds the other ranks get to report once one rank has finished with a failure
FAILURE_GRACE_S = 5.0
#: ``MALLOC_MMAP_THRESHOLD_``: glibc serves every allocation of this many bytes or more with a mapping of its own,
#: so a freed tensor returns to the OS and RSS tracks live memory (docs/design.md, "Memory, measured"). One page, the
#: least that can be: at 64 KiB a model that makes many small tensors (a state-space model's reference scan, a state
#: and an output a token a layer) drew them from glibc's heap, whose freed blocks stay resident in holes that depend
#: on the order glibc met them in, and a two-layer Mamba's measured footprint moved by +-8 MiB from process to process
#: (docs/results/families.md). Below a page only small objects share the heap.
MMAP_THRESHOLD_BYTES = 4096
#: oneDNN's primitive caches on a CPU rank (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, and ideep's
#: ``LRU_CACHE_CAPACITY`` in PyTorch's mkldnn ops), 1024 primitives each by default. A bf16 matmul of a new
#: shape adds one, with its packed weights: torch 2.13's CPU ``grouped_mm`` held 2.3 MiB more per new shape
#: (4 experts of 256x512), and a mixture of experts routes a new token count to each expert every step, so
#: a tiny Mixtral's bf16 run grew 20-80 MiB a step (RSS, live tensors constant) and a probe's peak depended
#: on how many steps it ran. At 16 that run holds steady within 3% of its tensors, and a dense Qwen2-shaped
#: model's bf16 step is as fast as with the default (0.79 vs 0.85 s). Set the same for CPU training runs.
ONEDNN_CACHE_CAPACITY = 16


class RankProcess(Protocol):
    """A rank's process as the launcher handles it: one it started (:class:`subprocess.Popen`) or one a warm parent
    forked (:class:`autofit.probe.warm.WarmRank`); either leads its own session (its pid is its process group)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class RankOutcome:
    """What one rank left behind: its result file (or None) and the tail of its log."""

    rank: int
    returncode: int | None
    result: RankResult | None
    """What the rank wrote (an unreadable file: an ``error`` saying so), or None when it wrote nothing."""
    log_tail: str
    pid: int = 0
    """The rank's process id."""
    killed_by_us: bool = False
    """Whether this process ended the rank (timeout, or a peer failed) rather than the rank exiting."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(base: dict[str, str], rank: int, world_size: int, port: int, kind: str) -> dict[str, str]:
    """The environment of one rank started here: torch.distributed's rendezvous variables over loopback and
    :func:`training_env` for ``world_size`` ranks sharing this machine's cores."""
    env = training_env(base, kind, local_ranks=world_size, cores=available_cores())
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        # the worker's parent, so it can tell a dead parent from a live one that is PID 1 (a container)
        AUTOFIT_PARENT_PID=str(os.getpid()),
    )
    return env


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, what a container's cpuset allows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def training_env(base: dict[str, str], kind: str, local_ranks: int, cores: int,
                 tensor_parallel: int = 1) -> dict[str, str]:
    """The environment a probe rank runs in, as a training run's rank would: ``base`` (what the user set wins)
    plus what the probe's measurement or the ranks' sharing of one host needs, and nothing else.

    * ``MALLOC_MMAP_THRESHOLD_`` on the CPU accelerator only: there the device's memory is the process's RSS,
      which must track live tensors (docs/design.md, "Memory, measured"). On CUDA the device memory is NVML's
      and the host's allocator is left as training leaves it.
    * ``OMP_NUM_THREADS`` = ``cores // local_ranks`` where unset: ``local_ranks`` ranks share this host's
      ``cores``, and without it each starts one OpenMP thread per core. DeepSpeed's launcher sets the same
      figure (``cores_per_rank``, deepspeed/launcher/launch.py with ``--bind_cores_to_rank``); ``torchrun``
      sets 1 for more than one local rank (torch/distributed/run.py), which starves a CPU rank's matmuls.
    * ``CUDA_DEVICE_MAX_CONNECTIONS=1`` only with ``tensor_parallel > 1``: Megatron-LM's tensor/sequence
      parallel communication overlap needs its kernels queued in launch order on one hardware queue and
      refuses to run without it. DeepSpeed ZeRO neither reads nor needs it (no DeepSpeed source file names it):
      its ``overlap_comm`` runs reductions on a stream of its own (``reduction_stream``,
      deepspeed/runtime/zero/stage_1_and_2.py) and synchronises with events, and one hardware queue would
      serialise that stream behind the compute. autofit's candidates have no tensor parallelism, so a probe
      sets it only where the user did (``base``), as their training would run.
    * ``DS_ACCELERATOR=cpu`` and oneDNN's cache capacities on the CPU accelerator (:data:`ONEDNN_CACHE_CAPACITY`).
    * On CUDA, ``TORCH_CUDA_ARCH_LIST`` without architecture suffixes (``9.0a`` as ``9.0``) where it has them:
      DeepSpeed's JIT builder cannot parse them (:func:`autofit.core.software.deepspeed_arch_list`).
    * ``PYTHONPATH`` with this autofit first, ``PYTHONUNBUFFERED=1``.
    """
    env = without_secrets(base)  # the queue's URL and libpq's credentials: never in user code's environment
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(1, local_ranks))))
    if kind == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_BYTES)
        env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
        env.setdefault("LRU_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    else:
        if tensor_parallel > 1:
            env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        if arch_list := deepspeed_arch_list(env.get("TORCH_CUDA_ARCH_LIST")):
            env["TORCH_CUDA_ARCH_LIST"] = arch_list  # as the ops were built (autofit.probe.ops.load_ops)
    env["PYTHONPATH"] = with_package_root(env.get("PYTHONPATH"))
    return env


def with_package_root(pythonpath: str | None) -> str:
    """``pythonpath`` with this autofit's root first, once: a probe imports this autofit wherever its caller
    runs from (the agents of several nodes get it from :func:`autofit.probe.elastic.node_launch`, their ranks
    from :func:`training_env`, so the root is already there the second time)."""
    package_root = str(Path(__file__).resolve().parents[2])
    rest = [p for p in pythonpath.split(os.pathsep) if p != package_root] if pythonpath else []
    return os.pathsep.join([package_root, *rest])


def launch(spec: ProbeSpec, workdir: Path, world_size: int, timeout_s: float,
           warm: WarmParent | None = None) -> tuple[list[RankOutcome], bool]:
    """Run ``world_size`` worker ranks of ``spec``; returns each rank's outcome and whether the deadline passed.
    ``warm``: the search's warm parent, which forks each rank it can (:mod:`autofit.probe.warm`); a rank it
    cannot serve, or every rank without one, starts as a fresh ``python -m autofit.probe.rank.worker``."""
    spec_path = workdir / "spec.json"
    port = free_port()
    spec = spec.launched(result_dir=str(workdir))
    spec_path.write_text(json.dumps(spec.to_json()))
    procs: list[RankProcess] = []
    oom_kills_before = oom_kills()
    exited: list[bool] = []
    try:
        for rank in range(world_size):
            env = rank_env(dict(os.environ), rank, world_size, port, spec.hardware.kind)
            procs.append(start_rank(spec_path, env, workdir / f"rank{rank}.log", warm))
        timed_out = wait_for_ranks(procs, time.monotonic() + timeout_s, lambda rank, code: _finished_badly(workdir, rank, code))
    finally:
        exited = [proc.poll() is not None for proc in procs]
        for proc in procs:
            kill_group(proc)
    outcomes = [
        RankOutcome(
            rank,
            proc.returncode,
            read_rank_result(workdir / f"rank{rank}.json", rank),
            _tail(workdir / f"rank{rank}.log"),
            pid=proc.pid,
            killed_by_us=not exited[rank],
        )
        for rank, proc in enumerate(procs)
    ]
    return _mark_oom_kills(outcomes, oom_kills_before), timed_out


def start_rank(spec_path: Path, env: dict[str, str], log_path: Path, warm: WarmParent | None) -> RankProcess:
    """One rank of the probe ``spec_path`` holds, in the environment ``env``, its output in ``log_path``: forked by
    ``warm`` where it can, else a fresh process; either way in a session of its own."""
    forked = warm.fork_rank(spec_path, env, log_path) if warm is not None else None
    if forked is not None:
        return forked
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "autofit.probe.rank.worker", str(spec_path)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=os.getcwd(),
        )


def _mark_oom_kills(outcomes: list[RankOutcome], oom_kills_before: int | None) -> list[RankOutcome]:
    """Give a rank the kernel's OOM killer ended (no result, SIGKILL not sent by us) its ``oom`` result."""
    suspects = [o for o in outcomes if o.result is None and not o.killed_by_us and ended_by_sigkill(o.returncode)]
    if not suspects:
        return outcomes
    kernel_log, oom_kills_after = read_kernel_log(), oom_kills()
    for outcome in suspects:
        verdict = classify_exit(
            outcome.returncode,
            outcome.pid,
            killed_by_us=outcome.killed_by_us,
            kernel_log=kernel_log,
            oom_kills_before=oom_kills_before,
            oom_kills_after=oom_kills_after,
        )
        if verdict is not None:
            outcome.result = RankResult(rank=outcome.rank, **verdict)
    return outcomes


def wait_for_ranks(procs: Sequence[RankProcess], deadline: float,
                   failed: Callable[[int, int | None], bool]) -> bool:
    """Wait until every rank exits; once ``failed(rank, returncode)`` says one has, its peers get
    :data:`FAILURE_GRACE_S` (they would wait forever in a collective). True when the deadline passed."""
    failed_at: float | None = None
    while True:
        codes = [proc.poll() for proc in procs]
        if all(code is not None for code in codes):
            return False
        now = time.monotonic()
        if now > deadline:
            return True
        if failed_at is None and any(failed(rank, code) for rank, code in enumerate(codes)):
            failed_at = now
        if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
            return False
        time.sleep(0.02)


def _finished_badly(workdir: Path, rank: int, code: int | None) -> bool:
    if code is None:
        return False
    result = read_rank_result(workdir / f"rank{rank}.json", rank)
    return result is None or result.status != "ok"


def kill_group(proc: RankProcess) -> None:
    """SIGKILL the rank's whole session (it and anything it started), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # no group yet: a forked rank between fork and setsid
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: Path, n_bytes: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n_bytes:].decode("utf-8", "replace")
