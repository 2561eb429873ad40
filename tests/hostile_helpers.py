"""Running autofit as a real process against hostile input (issue 40): an entry file written from
:data:`ENTRY` with code at import, in the entry function or in ``forward``, and the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENTRY = '''\
import os, sys
{at_import}
import torch
from torch import nn
from autofit import Workload


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x):
        {in_forward}
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def tiny_workload():
    {at_call}
    return Workload(model=Tiny, batch=lambda n: torch.randn(n, 16), name="tiny")
'''

#: a fast estimate: every dimension fixed
FIXED = ["--hardware", "h100-80gb", "--global-batch", "8", "--set", "micro_batch_size=4", "--set", "zero_stage=0",
         "--set", "precision=fp32", "--set", "checkpoint_ratio=0.0",
         "--set", "compile=off", "--optimizer", "sgd"]


def make_entry(folder: Path, name: str = "tiny", at_import: str = "", at_call: str = "pass",
               in_forward: str = "pass") -> str:
    """An entry file in ``folder``; its entry string."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(ENTRY.format(at_import=at_import, at_call=at_call, in_forward=in_forward))
    return f"{folder / name}.py:tiny_workload"


def env(**extra: str | None) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOFIT_STORAGE", "PG"))}
    out.update(PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", AUTOFIT_NO_CACHE="1", AUTOFIT_TRACE_WORKERS="1",
               OMP_NUM_THREADS="1")
    for key, value in extra.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def autofit(*args: str, cwd: Path | None = None, timeout: float = 180,
            environ: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m autofit ARGS`` in a subprocess (the module form: ``autofit/__main__.py``)."""
    return subprocess.run([sys.executable, "-m", "autofit", *args], cwd=cwd or ROOT, env=environ or env(),
                          capture_output=True, text=True, timeout=timeout)


def python(code: str, timeout: float = 120, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ or env(), capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(res: subprocess.CompletedProcess[str], word: str = "") -> bool:
    """Exit 1, no traceback, an ``autofit: error:`` line (naming ``word``)."""
    return (res.returncode == 1 and "Traceback" not in res.stderr and "autofit: error:" in res.stderr
            and word.lower() in res.stderr.lower())
