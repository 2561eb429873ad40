"""DeepSpeed's compiled ops, built or loaded once before the first probe: ``python -m autofit.probe.ops OP ...``.

DeepSpeed JIT-builds an optimizer's op (FusedAdam, CPU Adam/Lion, async I/O) inside the first
``deepspeed.initialize`` that needs it: on a 2-core CPU building ``fused_adam`` takes 64 s of a first
probe's 69, time the probe's timeout would otherwise have to allow for. :func:`prepare_ops` does it
up front, as its own step: it clears the build locks a killed build left behind, then loads every op
the candidates need (:func:`autofit.core.software.ops_needed`) in one subprocess, through the
accelerator's own builders (``get_accelerator().create_op_builder(...).load()``), so the probes
find them built in torch's extension cache.

Where the search calls it (wired by the search's owner): once after enumeration and before the
first probe, ``prepare_ops(candidates, hardware)``, reported as a progress step; its seconds are
not a probe's. A failed build is no dead end: :meth:`OpsReport.software` marks it, and the probes and the
emitted JSON run AdamW as DeepSpeed's ``torch_adam`` where FusedAdam failed. Stale locks are cleared
again before every probe (:func:`autofit.probe.run.run_probe`): a probe killed at its timeout mid-build
leaves one for the next.

A lock is torch's ``FileBaton`` (``<build dir>/lock``, torch/utils/cpp_extension.py): a file whose
existence is the lock, with no owner recorded. A build that is killed leaves it, and every later
build of that op waits on it forever. A lock is stale when no process works in its build directory
(the lock holder runs ``ninja`` there) and it is older than :data:`STALE_AFTER_S`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autofit.core.software import OP_BUILDERS, Software, deepspeed_arch_list, ops_needed
from autofit.core.storage_url import without_secrets
from autofit.machine.lifetime import PARENT_PID_ENV, end_session_with_parent, kill_session, parent_from_env
from autofit.machine.software import detect_software

#: a lock younger than this may belong to a build that has not started ninja yet
STALE_AFTER_S = 30.0


@dataclass(frozen=True)
class OpsReport:
    """What :func:`prepare_ops` did."""

    ops: tuple[str, ...]
    """The ops the candidates need, sorted."""
    loaded: dict[str, str] = field(default_factory=dict)
    """Op -> ``ok`` or the one-line error its build gave."""
    cleared_locks: tuple[str, ...] = ()
    """Stale lock files removed first."""
    seconds: float = 0.0
    """Wall seconds of the whole step."""
    arch_list: str | None = None
    """``TORCH_CUDA_ARCH_LIST`` as the builds (and the probes) read it, where DeepSpeed could not read this
    process's (:func:`autofit.core.software.deepspeed_arch_list`); None where it was left as it was."""

    def software(self, base: Software) -> Software:
        """``base`` with the ops whose build failed marked (:attr:`Software.failed_ops`): AdamW then runs as
        ``torch_adam`` where FusedAdam failed (:func:`autofit.core.software.uses_torch_adam`); a probe of a candidate
        needing another failed op fails with its error (and a later enumeration's rules prune it)."""
        failed = frozenset(op for op, state in self.loaded.items() if state != "ok")
        return replace(base, failed_ops=base.failed_ops | failed) if failed else base

    def lines(self) -> list[str]:
        """What it did, one progress line each: the locks removed, then each op's state."""
        said = [f"removed a stale build lock: {lock}" for lock in self.cleared_locks]
        if self.ops:
            states = ", ".join(f"{op} {state}" for op, state in self.loaded.items())
            said.append(f"DeepSpeed ops: {states} ({self.seconds:.1f} s)")
        if self.arch_list is not None:
            said.append(f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')} read as {self.arch_list}: "
                        "DeepSpeed's op builder parses no architecture suffix; set the same where you train")
        return said


def extensions_roots(env: dict[str, str] | None = None) -> tuple[Path, ...]:
    """Where torch builds extensions: ``TORCH_EXTENSIONS_DIR``, else its per-user cache (``torch_extensions``)."""
    env = without_secrets(os.environ) if env is None else env
    if env.get("TORCH_EXTENSIONS_DIR"):
        return (Path(env["TORCH_EXTENSIONS_DIR"]),)
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return (cache / "torch_extensions",)


def busy_build_dirs(proc: Path = Path("/proc")) -> set[Path]:
    """Working directories of the running processes (a build's ninja works in its build directory)."""
    busy: set[Path] = set()
    for entry in proc.iterdir() if proc.is_dir() else ():
        if entry.name.isdigit():
            try:
                busy.add(Path(os.readlink(entry / "cwd")))
            except OSError:
                continue
    return busy


def stale_locks(roots: tuple[Path, ...], busy: set[Path], now: float, min_age_s: float = STALE_AFTER_S) -> list[Path]:
    """Lock files under ``roots`` (``<op>/lock`` or ``<pyXY_acc>/<op>/lock``) whose build nobody runs."""
    found: list[Path] = []
    for root in roots:
        for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
            try:
                age = now - lock.stat().st_mtime
            except OSError:
                continue
            working = any(b == lock.parent or lock.parent in b.parents for b in busy)
            if age > min_age_s and not working:
                found.append(lock)
    return sorted(found)


def clear_stale_locks(roots: tuple[Path, ...] | None = None) -> list[Path]:
    """Remove the stale build locks; returns the ones removed."""
    removed = []
    for lock in stale_locks(roots or extensions_roots(), busy_build_dirs(), time.time()):
        try:
            lock.unlink()
            removed.append(lock)
        except FileNotFoundError:
            continue
    return removed


def prepare_ops(candidates: list[Any], hardware: Any, software: Software | None = None,
                timeout_s: float = 1800.0) -> OpsReport:
    """Clear stale locks, then build or load every DeepSpeed op ``candidates`` (Configs) need on ``hardware``."""
    started = time.monotonic()
    software = software if software is not None else detect_software()
    keys = sorted({(c.optimizer, c.offload_optimizer, c.offload_params) for c in candidates})
    ops = ops_needed(keys, hardware.kind, software)
    cleared = tuple(str(p) for p in clear_stale_locks())
    loaded = load_ops(ops, hardware.kind, timeout_s) if ops else {}
    arch_list = deepspeed_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST")) if ops and hardware.kind == "cuda" else None
    return OpsReport(ops=ops, loaded=loaded, cleared_locks=cleared, seconds=time.monotonic() - started,
                     arch_list=arch_list)


def load_ops(ops: tuple[str, ...], device_kind: str, timeout_s: float) -> dict[str, str]:
    """Build or load ``ops`` in one subprocess (a build that crashes must not take the caller down). It leads a
    session of its own, the build's ``ninja`` and compilers in it, which ends with the build, at the timeout and
    when the caller dies (:mod:`autofit.machine.lifetime`): a killed worker leaves no build behind."""
    env = without_secrets(os.environ) | {PARENT_PID_ENV: str(os.getpid())}
    if device_kind == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    elif arch_list := deepspeed_arch_list(env.get("TORCH_CUDA_ARCH_LIST")):
        env["TORCH_CUDA_ARCH_LIST"] = arch_list  # the probes' ranks read the same (launch.training_env)
    build = subprocess.Popen([sys.executable, "-m", "autofit.probe.ops", *ops], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = build.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict.fromkeys(ops, f"not built within {timeout_s:g} s")
    finally:
        _end_session(build)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        return dict.fromkeys(ops, f"exit {build.returncode}: {tail}"[:300])
    return {str(k): str(v) for k, v in json.loads(lines[-1]).items()}


def _end_session(build: subprocess.Popen[str]) -> None:
    """Kill what is left of the build's session (nothing after a build that finished) and reap the build."""
    kill_session(build.pid)
    build.wait()


def load_ops_here(ops: list[str]) -> dict[str, str]:
    from deepspeed.accelerator import get_accelerator

    result: dict[str, str] = {}
    for op in ops:
        try:
            builder = get_accelerator().create_op_builder(OP_BUILDERS[op])
            if builder is None:
                result[op] = f"{get_accelerator().device_name()} has no {OP_BUILDERS[op]}"
                continue
            builder.load(verbose=False)
            result[op] = "ok"
        except Exception as exc:  # a failed build is a result: the candidates needing it will error
            result[op] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"[:300]
    return result


if __name__ == "__main__":
    end_session_with_parent(parent_from_env(os.getppid()))
    print(json.dumps(load_ops_here(sys.argv[1:])))
    sys.stdout.flush()
    os._exit(0)
