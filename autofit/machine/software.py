"""What this machine's software runs (:class:`autofit.core.software.Software`, detected): the optional
libraries, the build tools and DeepSpeed's compiled ops. Detection imports nothing heavy: packages are looked
up with ``importlib.util.find_spec`` and DeepSpeed's list of pre-built ops is read from the file its
``setup.py`` writes (``deepspeed/git_version_info_installed.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from autofit.core.errors import AutofitError
from autofit.core.software import CUDA_CLUSTER, Software


@functools.lru_cache(maxsize=1)
def detect_software() -> Software:
    """This machine's :class:`Software` (cached: it does not change during a run)."""
    return Software(
        torchao=_has_module("torchao"),
        flash_attn=_has_module("flash_attn"),
        adam_mini=_has_module("adam_mini"),
        cuda_toolkit=find_nvcc() is not None,
        cxx_compiler=find_cxx(INDUCTOR_CXX) is not None,
        triton=_has_module("triton"),
        host_compiler=find_cxx(CPP_EXTENSION_CXX) is not None,
        prebuilt_ops=frozenset(op for op, built in deepspeed_installed_ops().items() if built),
        nvme_path=os.environ.get(NVME_PATH_ENV) or None,
        memlock_bytes=memlock_limit_bytes(),
        libaio=None,
        libaio_check=async_io_compatible,
        source="here",
    )


def read_software_file(path: str) -> Software:
    """``--software FILE``: the target's software as a JSON object of :meth:`Software.to_dict`'s keys (what
    ``python -m autofit.machine.software`` prints on the target); a key left out keeps :data:`CUDA_CLUSTER`'s value.
    A file that cannot be read, is no JSON object or states a bad value is one :class:`AutofitError`."""
    try:
        values = json.loads(Path(path).expanduser().read_text())
    except OSError as error:
        raise AutofitError(f"--software {path!r} cannot be read: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise AutofitError(f"--software {path!r} is not JSON: {error}") from None
    if not isinstance(values, dict):
        raise AutofitError(f"--software {path!r} must hold a JSON object of software facts, not {type(values).__name__}")
    return Software.from_dict(values, CUDA_CLUSTER, source=path)


def software_here_dict() -> dict[str, object]:
    """This machine's software as a ``--software FILE`` states it, libaio checked (a build test, seconds)."""
    software = detect_software()
    return dataclasses.replace(software, libaio=software.has_libaio()).to_dict()


def main() -> None:
    """``python -m autofit.machine.software > target.json`` on the machine that will train: its software, for
    ``--software target.json`` where the plan is made."""
    print(json.dumps(software_here_dict(), indent=1))


#: ``--nvme-path`` travels to the search, the emitted JSON and the probes in this variable
NVME_PATH_ENV = "AUTOFIT_NVME_PATH"


def check_nvme_path(path: str) -> str:
    """``path`` as an absolute directory this process can write to, or one clear :class:`AutofitError`."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise AutofitError(f"--nvme-path {path!r} is not an existing directory")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise AutofitError(f"--nvme-path {path!r} is not writable: {error.strerror}") from None
    refused = o_direct_refused(folder)
    if refused:
        raise AutofitError(f"--nvme-path {path!r} refuses O_DIRECT ({refused}): DeepSpeed's async_io opens its swap "
                           "files with O_DIRECT (csrc/aio/common/deepspeed_aio_common.cpp); use a directory on the "
                           "NVMe drive's own filesystem")
    return str(folder.resolve())


def o_direct_refused(folder: Path) -> str | None:
    """Why a file in ``folder`` cannot be opened with ``O_DIRECT`` (its filesystem refuses it), or None."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return "this system has no O_DIRECT"
    path = folder / f".autofit-odirect-{os.getpid()}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL | flag, 0o600)
    except OSError as error:
        return error.strerror or str(error)
    os.close(fd)
    path.unlink(missing_ok=True)
    return None


def memlock_limit_bytes() -> int | None:
    """``RLIMIT_MEMLOCK``'s soft limit in bytes where it binds ``mlock``; None for root (``CAP_IPC_LOCK``) or
    an unlimited limit. Only DeepSpeed's NVMe swap buffers are ``mlock``-ed; ``cudaHostAlloc`` ignores it."""
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return None
    try:
        import resource  # POSIX only: absent on Windows
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


#: inductor's C++ compiler where ``CXX`` is unset (torch/_inductor/config.py, ``cpp.cxx``)
INDUCTOR_CXX = "clang++" if sys.platform == "darwin" else "g++"


#: the compiler DeepSpeed's op builders JIT-build with where ``CXX`` is unset: torch's
#: ``torch.utils.cpp_extension.get_cxx_compiler`` (``load`` writes it into the ninja file)
CPP_EXTENSION_CXX = "c++"


def find_cxx(default: str) -> Path | None:
    """The C++ compiler a tool whose default is ``default`` runs: ``$CXX`` where set, else ``default``; None where
    it is not found. Both tools read ``os.environ.get("CXX", default)``, so a ``CXX`` set but empty is no compiler
    to them (measured, torch 2.13: inductor raises ``PermissionError: ''`` and ``cpp_extension`` runs ``''``)."""
    found = shutil.which(os.environ.get("CXX", default))
    return Path(found) if found else None


@functools.lru_cache(maxsize=1)
def async_io_compatible(timeout_s: float = 120.0) -> bool:
    """DeepSpeed's ``AsyncIOBuilder().is_compatible()`` (it compiles and links a test of libaio's ``io_submit``),
    in a subprocess: DeepSpeed's import and its compiler run stay out of this process."""
    code = ("from deepspeed.ops.op_builder.async_io import AsyncIOBuilder\n"
            "print('AIO', AsyncIOBuilder().is_compatible(verbose=False))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return "AIO True" in done.stdout


def find_nvcc() -> Path | None:
    """``nvcc`` where ``torch.utils.cpp_extension._find_cuda_home`` looks: CUDA_HOME / CUDA_PATH, PATH, /usr/local/cuda."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(variable)
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return Path(home) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    default = Path("/usr/local/cuda/bin/nvcc")
    return default if default.is_file() else None


def deepspeed_installed_ops() -> dict[str, bool]:
    """``installed_ops`` from DeepSpeed's ``git_version_info_installed.py``; empty without DeepSpeed."""
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        return {}
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(next(iter(spec.submodule_search_locations))) / "git_version_info_installed.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return {}
    return installed_ops_from_source(tree)


def installed_ops_from_source(tree: ast.Module) -> dict[str, bool]:
    """The ``installed_ops = {...}`` literal of a parsed ``git_version_info_installed.py``."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "installed_ops" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return {str(k): bool(v) for k, v in value.items()} if isinstance(value, dict) else {}
    return {}


if __name__ == "__main__":
    main()
