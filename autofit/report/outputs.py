"""What a command writes, checked before it starts and written all or nothing.

``--out`` must be a regular file or absent, in a folder that can be written; ``--report`` absent, empty, or a
report autofit wrote before (it carries :data:`REPORT_MARKER`). Both are checked before anything is traced
(:func:`check_outputs`), and written at the end all or nothing (:func:`commit_outputs`): the report is built in
a temporary folder beside its target (:func:`staged_report`) and renamed into place, then ``--out`` is written
(:func:`write_deepspeed`, the one writer of the DeepSpeed JSON); a failure leaves neither. Under ``--json``
stdout is the document alone (:func:`json_stdout`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autofit.core.errors import AutofitError
from autofit.ds.emit import current_umask, existing_mode, write_json_atomic

#: the file autofit writes into every report folder: a folder with it may be written over
REPORT_MARKER = ".autofit-report"
#: the real stdout while :func:`json_stdout` sends file descriptor 1 to stderr
_DOCUMENT_FD: int | None = None


def check_outputs(out: str | os.PathLike[str] | None, report: str | os.PathLike[str] | None) -> None:
    """One :class:`AutofitError` line before the search where ``out`` or ``report`` could not be written, or
    would replace what autofit did not write."""
    if out is not None:
        path = Path(out)
        existing_mode(path)  # a folder, a FIFO, a device: refused
        _check_writable_folder(path.parent, f"--out {out}")
    if report is not None:
        check_report_folder(Path(report))


def check_report_folder(folder: Path) -> None:
    """``folder`` is absent, empty, or a report autofit wrote; its parent can be written."""
    if folder.exists() or folder.is_symlink():
        if not folder.is_dir():
            raise AutofitError(f"--report {folder} is not a folder: name a folder for the report")
        if any(folder.iterdir()) and not (folder / REPORT_MARKER).is_file():
            raise AutofitError(f"--report {folder} has files autofit did not write: name a new or empty folder")
    _check_writable_folder(folder.parent, f"--report {folder}")


def _check_writable_folder(folder: Path, what: str) -> None:
    """The nearest existing folder of ``folder`` is a folder this process may write to."""
    here = folder.absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        raise AutofitError(f"{what}: {here} is not a folder")
    if not os.access(here, os.W_OK | os.X_OK):
        raise AutofitError(f"{what}: cannot write in {here}")


def write_deepspeed(out: str | os.PathLike[str], deepspeed: dict[str, Any]) -> None:
    """The one writer of a DeepSpeed JSON a user trains with (``autofit run --out``, :func:`autofit.search`'s
    ``out``): atomically (:func:`autofit.ds.emit.write_json_atomic`: a reader never sees half a file, a failure
    leaves the old one), a NaN or an infinity refused, the mode of the file it replaces kept."""
    write_json_atomic(Path(out), deepspeed)


@dataclass(frozen=True)
class StagedReport:
    """A report being written: a temporary folder beside ``--report``, renamed into place by
    :func:`commit_outputs`."""

    folder: Path
    """The temporary folder the report is written into."""
    target: Path
    """``--report``: where the report goes."""

    def final(self, path: Path) -> Path:
        """Where ``path``, a file written into :attr:`folder`, lies once the report is in place."""
        return self.target / path.relative_to(self.folder)


@contextmanager
def staged_report(report: str | os.PathLike[str] | None) -> Iterator[StagedReport | None]:
    """A temporary folder beside ``report`` to write the report into (None without ``report``), removed on the way
    out unless :func:`commit_outputs` renamed it into place."""
    if report is None:
        yield None
        return
    target = Path(report)
    check_report_folder(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield StagedReport(folder, target)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def commit_outputs(deepspeed: dict[str, Any], out: str | os.PathLike[str] | None, staged: StagedReport | None) -> None:
    """The report written into ``staged`` (:func:`staged_report`; None: no report) renamed into place, then ``out``
    written (:func:`write_deepspeed`; None: nowhere), all or nothing: where ``out`` fails the report goes with it
    and a previous one comes back."""
    if staged is None:
        if out is not None:
            write_deepspeed(out, deepspeed)
        return
    target = staged.target
    (staged.folder / REPORT_MARKER).write_text("written by autofit: `autofit run --report` may write over this folder\n")
    os.chmod(staged.folder, 0o777 & ~current_umask())
    old: Path | None = None
    try:
        old = _set_aside(target)
        os.rename(staged.folder, target)
        try:
            if out is not None:
                write_deepspeed(out, deepspeed)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)  # the report goes with the --out that failed
            if old is not None:
                os.rename(old, target)
                old = None
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _set_aside(target: Path) -> Path | None:
    """A previous report (or empty folder) at ``target`` moved beside it, to be dropped once the new one is in."""
    if not target.exists():
        return None
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    os.rmdir(aside)
    os.rename(target, aside)
    return aside


@contextmanager
def json_stdout(as_json: bool) -> Iterator[None]:
    """Under ``--json``: file descriptor 1 is stderr while the command runs (the model's ``print``, DeepSpeed's
    logger, a C extension's ``write(1, ...)`` and every subprocess), and :func:`emit_document` writes to the real
    stdout, so stdout holds autofit's document alone."""
    global _DOCUMENT_FD
    if not as_json or _DOCUMENT_FD is not None or not _stdout_is_fd_1():  # e.g. click's CliRunner: nothing to split
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    _DOCUMENT_FD = saved
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        _DOCUMENT_FD = None



def _stdout_is_fd_1() -> bool:
    try:
        return sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):
        return False


def emit_document(text: str) -> None:
    """The command's one document (``--json``) on stdout: the real one while :func:`json_stdout` holds fd 1."""
    if _DOCUMENT_FD is None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    data = (text + "\n").encode()
    while data:
        data = data[os.write(_DOCUMENT_FD, data):]

