"""Soak the queue: many short searches, several workers, workers SIGKILLed and the database restarted at random.

    python -m benchmarks.robustness.queue_soak [--searches 60] [--workers 4] [--probe-s 1] [--lease 8] [--chaos-s 10] [--seed 0]

A throwaway PostgreSQL cluster on loopback (tests/schedule/pgserver.py: ``initdb`` + ``pg_ctl``; as root it runs as
the ``postgres`` user), the tiny model of tests/tuner/tiny.py queued ``--searches`` times (a distinct global batch
each, micro-batches 1/2/4/8, 3 search probes, fp32 SGD on this CPU). ``--workers`` worker processes run the
product's worker loop (:meth:`autofit.schedule.worker.Worker.serve`: claims, leases, signals, database retries;
tests/schedule/sleepy_worker.py), each probe answered by the cost model after ``--probe-s`` seconds instead of
DeepSpeed steps, so the figures are the queue's, not training's. Every ``--chaos-s`` seconds on average one of:
a random busy worker's process group SIGKILLed (a replacement started a second later; a search is
killed at most twice, as a third would end it ``failed`` by the claim cap, ``worker --max-claims``), or the server stopped with
``pg_ctl -m immediate`` (every connection dropped) and started again after 1-3 s.

Checks: every search ``done``, one study per search, no config probed twice by the search in a study. Records
searches per hour (wall time from the first worker's start to the last search done) and takeover latency
(from the SIGKILL to another worker's claim of the search the killed worker held; the lease is ``--lease`` s) to
benchmarks/results/queue_soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests" / "schedule"

from autofit.schedule import queue  # noqa: E402
from autofit.schedule.store import FINISHED, optuna_storage  # noqa: E402
from autofit.tuner.storage import database_errors  # noqa: E402
from tests.schedule.pgserver import Server, server_bin  # noqa: E402
from tests.schedule.queue_helpers import queue_tiny  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "queue_soak.json"


class Workers:
    """The worker processes, by name; a killed one is replaced by a new name."""

    def __init__(self, url: str, probe_s: float, lease_s: float, idle_exit_s: float, log_dir: Path) -> None:
        self.url, self.probe_s, self.lease_s, self.idle_exit_s, self.log_dir = url, probe_s, lease_s, idle_exit_s, log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started = 0

    def start(self) -> str:
        name = f"soak-{self.started}"
        self.started += 1
        env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu")
        log = open(self.log_dir / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(
            [sys.executable, str(TESTS / "sleepy_worker.py"), self.url, name, str(self.probe_s), str(self.lease_s),
             str(self.idle_exit_s)], env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        return name

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def alive(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is None]


def _rows(url: str) -> list[Any] | None:
    try:
        return queue.search_rows(url)
    except database_errors():
        return None  # the server is down this moment


class Takeovers:
    """From a SIGKILL to another worker's claim of the search the killed worker held, polled every 0.1 s."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.pending: list[tuple[str, str, float]] = []
        self.latencies: list[float] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def killed(self, search_id: str, worker: str, at: float) -> None:
        with self.lock:
            self.pending.append((search_id, worker, at))

    def _watch(self) -> None:
        while not self.done.wait(0.1):
            with self.lock:
                if not self.pending:
                    continue
            rows = _rows(self.url)
            if rows is None:
                continue
            now = time.monotonic()
            by_id = {r.id: r for r in rows}
            with self.lock:
                for item in list(self.pending):
                    search_id, worker, at = item
                    row = by_id[search_id]
                    if row.worker != worker or row.state != "running":
                        self.latencies.append(now - at)
                        self.pending.remove(item)


def _searched_twice(url: str, search_id: str) -> int:
    import optuna

    trials = optuna.load_study(study_name=queue.study_name(search_id), storage=optuna_storage(url)).get_trials(deepcopy=False)
    searched = [json.dumps(t.user_attrs["config"], sort_keys=True) for t in trials
                if "measured" in t.user_attrs and t.user_attrs["phase"] == "search"]
    return len(searched) - len(set(searched))


def soak(args: argparse.Namespace, server: Server, log_dir: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    url = server.new_database()
    ids = [queue_tiny(url, micro_batches=(1, 2, 4, 8), global_batch=16 * (n + 1), trials=3).id
           for n in range(args.searches)]
    workers = Workers(url, args.probe_s, args.lease, idle_exit_s=args.lease * 4, log_dir=log_dir)
    started = time.monotonic()
    for _ in range(args.workers):
        workers.start()
    takeovers = Takeovers(url)
    kills: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    last_done = started
    next_chaos = started + rng.expovariate(1 / args.chaos_s)
    while time.monotonic() - started < args.max_s:
        rows = _rows(url)
        if rows is not None:
            if all(r.state in FINISHED or r.state == "failed" for r in rows):
                last_done = time.monotonic()
                break
        now = time.monotonic()
        if now >= next_chaos and rows is not None:
            # a search is killed at most max_claims - 1 times: the next one would end it failed by design (the cap)
            killed = [k["search"] for k in kills]
            busy = [(r.worker, r.id) for r in rows if r.state == "running" and r.worker in workers.alive()
                    and killed.count(r.id) < queue.DEFAULT_MAX_CLAIMS - 1]
            if busy and rng.random() < args.kill_share:
                worker, search_id = rng.choice(busy)
                workers.kill(worker)
                takeovers.killed(search_id, worker, time.monotonic())
                kills.append({"worker": worker, "search": search_id, "at_s": round(now - started, 1)})
                time.sleep(1.0)
                workers.start()
            else:
                down_s = rng.uniform(1.0, 3.0)
                server.restart(down_s=down_s)
                restarts.append({"at_s": round(now - started, 1), "down_s": round(down_s, 1)})
            next_chaos = time.monotonic() + rng.expovariate(1 / args.chaos_s)
        time.sleep(0.5)
    wall_s = last_done - started
    deadline = time.monotonic() + 60  # the rest idle out
    while workers.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    for name in workers.alive():
        workers.kill(name)
    takeovers.done.set()
    rows = {r.id: r for r in queue.search_rows(url)}
    import optuna

    studies = optuna.get_all_study_names(optuna_storage(url))
    states = [rows[i].state for i in ids]
    repeated = {i: n for i in ids if (n := _searched_twice(url, i))}
    lat = sorted(takeovers.latencies)
    return {
        "searches": args.searches,
        "workers": args.workers,
        "workers_started": workers.started,
        "probe_s": args.probe_s,
        "lease_s": args.lease,
        "seed": args.seed,
        "wall_s": round(wall_s, 1),
        "searches_per_hour": round(args.searches / wall_s * 3600, 1),
        "done": states.count("done"),
        "states": {s: states.count(s) for s in sorted(set(states))},
        "all_done": states.count("done") == args.searches,
        "studies": len(studies),
        "searches_with_a_config_probed_twice": repeated,
        "claims": sum(rows[i].claims for i in ids),
        "not_done": {i: {"state": rows[i].state, "claims": rows[i].claims, "message": rows[i].message}
                     for i in ids if rows[i].state != "done"},
        "worker_kills": len(kills),
        "server_restarts": len(restarts),
        "takeover_latency_s": {
            "n": len(lat), "median": round(statistics.median(lat), 2) if lat else None,
            "max": round(lat[-1], 2) if lat else None, "min": round(lat[0], 2) if lat else None,
            "not_taken_over": len(takeovers.pending),
        },
        "kills": kills,
        "restarts": restarts,
        "machine": {"cpus": os.cpu_count(), "load_avg_1m_at_end": round(os.getloadavg()[0], 1),
                    "python": platform.python_version(), "host": "this project's shared CPU machine, no GPU"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--searches", type=int, default=60)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--probe-s", type=float, default=1.0, help="seconds each probe takes")
    parser.add_argument("--lease", type=float, default=8.0,
                        help="the workers' --lease (longer than an outage: a lease that runs out during one is a takeover)")
    parser.add_argument("--chaos-s", type=float, default=10.0, help="mean seconds between a kill or a restart")
    parser.add_argument("--kill-share", type=float, default=0.7, help="share of chaos events that kill a worker")
    parser.add_argument("--max-s", type=float, default=1200.0, help="give up after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    bindir = server_bin()
    if bindir is None:
        raise SystemExit("PostgreSQL server binaries not found (apt-get install postgresql)")
    server = Server(bindir).start()
    log_dir = Path(tempfile.mkdtemp(prefix="autofit-soak-logs-"))
    try:
        result = soak(args, server, log_dir)
    finally:
        server.stop()
    logs = [p.read_text(errors="replace") for p in sorted(log_dir.glob("*.log"))]
    result["worker_log_lines"] = {what: sum(log.count(what) for log in logs)
                                  for what in ("database error", "taken over", "given back", "Traceback")}
    print(f"worker logs: {log_dir}", file=sys.stderr)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("kills", "restarts")}, indent=1))
    if not result["all_done"] or result["searches_with_a_config_probed_twice"] or result["studies"] != args.searches:
        raise SystemExit("soak failed: see " + str(args.out))


if __name__ == "__main__":
    main()
