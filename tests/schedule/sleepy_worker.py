"""A worker process for the scheduler's tests: the product's worker loop (:meth:`autofit.schedule.worker.Worker.serve`:
its claims, leases, signal handling and database retries) on this CPU, with probes answered by the cost model after
``SLEEP_S`` seconds instead of DeepSpeed steps, so a test can restart the database or stop a worker mid-probe in
seconds. The server ends its sessions idle inside a transaction after ``LEASE_S`` (not the default minute): a test
that stops it there waits that long, not a minute, for the locks it held.

    python sleepy_worker.py URL NAME SLEEP_S LEASE_S IDLE_EXIT_S
"""

from __future__ import annotations

import sys
from functools import partial

from queue_helpers import model_prober

from autofit.machine.device import get_hardware
from autofit.machine.fingerprint import detect_machine
from autofit.schedule.worker import Worker
from autofit.tuner import storage


def main(url: str, name: str, sleep_s: str, lease_s: str, idle_exit_s: str) -> None:
    storage.IDLE_IN_TRANSACTION_S = float(lease_s)
    device = get_hardware("cpu")
    Worker(url, name, device, detect_machine(device), lease_s=float(lease_s), idle_exit_s=float(idle_exit_s),
           poll_s=0.2, prober=partial(model_prober, sleep_s=float(sleep_s))).serve()


if __name__ == "__main__":
    main(*sys.argv[1:6])
