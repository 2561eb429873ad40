"""Whether the trace cache may be believed: a cache folder is private to its user unless shared on
purpose. As ssh's ``StrictModes`` and git's ``safe.directory`` do, a folder owned by someone else, or one that
others can write, is not read: anyone who can read the model can compute its key (:mod:`autofit.trace.cache`),
so a key is no authentication. Such a folder is ignored with one line on stderr (the trace runs again, nothing is
written there). ``AUTOFIT_SHARED_CACHE=1`` shares a cache on purpose: any owner, and group-writable, but never
writable by everyone."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

#: set to 1 to use a cache folder shared with others (owned by another user, or group-writable)
SHARED_CACHE_ENV = "AUTOFIT_SHARED_CACHE"

_warned: set[str] = set()


def make_private(traces: Path) -> None:
    """Create the cache root and its ``traces`` folder 0700 (their parents as usual)."""
    traces.parent.parent.mkdir(parents=True, exist_ok=True)
    for folder in (traces.parent, traces):
        folder.mkdir(mode=0o700, exist_ok=True)


def distrust(traces: Path) -> str | None:
    """Why the cache at ``traces`` (and its root) must not be used, or None where it may."""
    shared = os.environ.get(SHARED_CACHE_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    for folder in (traces.parent, traces):
        try:
            found = os.stat(folder)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{folder} cannot be read ({exc.strerror})"
        if not stat.S_ISDIR(found.st_mode):
            return f"{folder} is not a folder"
        mode = stat.S_IMODE(found.st_mode)
        if mode & stat.S_IWOTH:
            return f"{folder} is writable by everyone (mode {mode:o})"
        if shared:
            continue
        if found.st_uid != os.getuid():
            return f"{folder} belongs to another user (uid {found.st_uid}); {SHARED_CACHE_ENV}=1 shares it on purpose"
        if mode & stat.S_IWGRP:
            return f"{folder} is writable by its group (mode {mode:o}); {SHARED_CACHE_ENV}=1 shares it on purpose"
    return None


def trusted(traces: Path) -> bool:
    """Whether the cache at ``traces`` may be read and written; where not, one line on stderr (once)."""
    why = distrust(traces)
    if why is None:
        return True
    if why not in _warned:
        _warned.add(why)
        print(f"autofit: ignoring the trace cache: {why} (chmod 700 it, or set AUTOFIT_CACHE_DIR to a private "
              "folder); tracing again", file=sys.stderr, flush=True)
    return False


def ignored_entry(path: Path, why: str) -> None:
    """One line on stderr for a cache entry that does not validate (it is traced again)."""
    print(f"autofit: ignored cache entry {path}: {why}", file=sys.stderr, flush=True)
