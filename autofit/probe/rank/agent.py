"""One node's agent of a multi-node probe: PyTorch's elastic launcher starting this node's ranks.

``python -m autofit.probe.rank.agent --nnodes=N --nproc-per-node=G --rdzv-endpoint=HOST:PORT --rdzv-id=ID
--ranks-on-host=R [--is-host=0|1]`` reads the probe's spec (one JSON line) on stdin, joins the c10d
rendezvous through ``torch.distributed.launcher.api.elastic_launch`` (``LaunchConfig``: ``rdzv_backend="c10d"``,
no restarts; what ``torchrun`` runs, torch/distributed/run.py) and starts G ranks of
:mod:`autofit.probe.rank.worker` in the environment training runs in (:func:`autofit.probe.launch.training_env`,
R ranks sharing this host's cores). It writes, on stdout, each rank's result as it appears
(``autofit-rank-result {json}``) and, for a rank that ended without one, how it ended
(``autofit-rank-exit {json}``): a rank the kernel's OOM killer took is read here, on its own node (its kernel
log, its memory cgroup's and the system's ``oom_kill`` counters, :mod:`autofit.probe.oom_killer`), and reported
as an ``oom`` on the host. Everything else it and its ranks print goes to the same stream, as log.

When its stdin closes (the probe is over, or the process that started it died, here or across ssh/srun) it
exits at once, and its ranks with it (each asks the kernel to kill it when its parent dies).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from autofit.probe.failure import classify_exit, read_kernel_log
from autofit.probe.launch import available_cores, training_env
from autofit.probe.oom_killer import oom_kills
from autofit.probe.records import ProbeSpec, RankResult

RESULT_MARK = "autofit-rank-result "
EXIT_MARK = "autofit-rank-exit "
_PRINT_LOCK = threading.Lock()


def emit(mark: str, record: dict[str, Any]) -> None:
    """One record line on stdout, whole (lines of the ranks' own output never split it)."""
    with _PRINT_LOCK:
        sys.stdout.write(mark + json.dumps(record, allow_nan=True) + "\n")
        sys.stdout.flush()


def parse_record(line: str) -> tuple[str, dict[str, Any]] | None:
    """``("result" | "exit", record)`` of an agent's record line; None for any other line (log)."""
    for mark, name in ((RESULT_MARK, "result"), (EXIT_MARK, "exit")):
        at = line.find(mark)  # a rank's unfinished line may precede it
        if at >= 0:
            try:
                record = json.loads(line[at + len(mark):])
            except ValueError:
                return None
            return (name, record) if isinstance(record, dict) else None
    return None


def exit_records(failures: dict[int, Any], reported: set[int], kernel_log: str, oom_kills_before: int | None,
                 oom_kills_after: int | None) -> list[dict[str, Any]]:
    """What to say of each failed rank (torch's ``ProcessFailure`` by global rank) that wrote no result: its
    exit code and pid, and a host ``oom`` result where the OOM killer ended it."""

    records = []
    for rank, failure in sorted(failures.items()):
        if rank in reported:
            continue
        verdict = classify_exit(failure.exitcode, failure.pid, killed_by_us=False, kernel_log=kernel_log,
                                oom_kills_before=oom_kills_before, oom_kills_after=oom_kills_after)
        result = RankResult(rank=rank, **verdict).to_json() if verdict is not None else None
        records.append({"rank": rank, "exitcode": failure.exitcode, "pid": failure.pid, "result": result})
    return records


class _Reporter:
    """Emits each ``rank<R>.json`` of ``workdir`` once, as it appears (polled in a thread)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.reported = workdir, set[int]()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="autofit-agent-reporter", daemon=True)

    def start(self) -> _Reporter:
        self._thread.start()
        return self

    def scan(self) -> None:
        with self._lock:
            for path in sorted(self.workdir.glob("rank*.json")):
                rank = int(path.stem[4:])
                if rank in self.reported:
                    continue
                try:
                    record = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                self.reported.add(rank)
                emit(RESULT_MARK, record)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self.scan()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.scan()


def _exit_when_stdin_closes() -> None:
    """Read stdin to its end; then the probe is over or its launcher died: end now (the ranks follow)."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        os._exit(3)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The agent's options (what :func:`autofit.probe.nodes.agent_argv` writes)."""
    parser = argparse.ArgumentParser(prog="python -m autofit.probe.rank.agent")
    for name in ("--nnodes", "--nproc-per-node", "--ranks-on-host"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--rdzv-endpoint", required=True)
    parser.add_argument("--rdzv-id", required=True)
    parser.add_argument("--is-host", type=int, choices=(0, 1), default=None)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:

    args = parse_args(argv)
    spec = ProbeSpec.from_json(json.loads(sys.stdin.readline()))
    threading.Thread(target=_exit_when_stdin_closes, name="autofit-agent-stdin", daemon=True).start()

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    workdir = Path(tempfile.mkdtemp(prefix="autofit-agent-"))
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec.launched(result_dir=str(workdir)).to_json()))
    os.environ.update(training_env(dict(os.environ), spec.hardware.kind, args.ranks_on_host, available_cores()))
    os.environ.pop("AUTOFIT_PARENT_PID", None)  # the ranks' parent is this agent (autofit.probe.rank.worker)
    config = LaunchConfig(
        min_nodes=args.nnodes, max_nodes=args.nnodes, nproc_per_node=args.nproc_per_node, run_id=args.rdzv_id,
        rdzv_backend="c10d", rdzv_endpoint=args.rdzv_endpoint,
        rdzv_configs={} if args.is_host is None else {"is_host": bool(args.is_host)},
        max_restarts=0, monitor_interval=0.2,
    )
    reporter = _Reporter(workdir).start()
    oom_kills_before = oom_kills()
    failures: dict[int, Any] = {}
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "autofit.probe.rank.worker", str(spec_path))
    except ChildFailedError as exc:
        failures = dict(exc.failures)
    finally:
        reporter.stop()
    if failures:
        for record in exit_records(failures, reporter.reported, read_kernel_log(), oom_kills_before, oom_kills()):
            emit(EXIT_MARK, record)
    shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
