"""What this machine's software can run: the optional libraries and DeepSpeed's compiled ops.

The search-space rules (:mod:`autofit.rules`) prune by it (fp8 without torchao, flash without
flash-attn, a DeepSpeed op that can neither be loaded nor built) and :mod:`autofit.emit` picks
DeepSpeed's ``torch_adam`` where FusedAdam cannot be built. Detection imports nothing heavy:
packages are looked up with ``importlib.util.find_spec`` and DeepSpeed's list of pre-built ops is
read from the file its ``setup.py`` writes (``deepspeed/git_version_info_installed.py``).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from autofit.errors import AutofitError


@dataclass(frozen=True)
class Software:
    """Libraries and build tools present; the defaults claim everything (a planning run on no machine)."""

    torchao: bool = True
    """``torchao`` is importable: fp8 training through ``torchao.float8`` (``pip install -e '.[fp8]'``)."""
    flash_attn: bool = True
    """``flash_attn`` is importable: the ``flash`` attention kernel."""
    adam_mini: bool = True
    """``adam_mini`` is importable: the ``adam_mini`` optimizer (the ``adam-mini`` package, ``.[train]``)."""
    cuda_toolkit: bool = True
    """``nvcc`` is found (as ``torch.utils.cpp_extension`` finds it): DeepSpeed's CUDA ops can be JIT-built."""
    cxx_compiler: bool = True
    """Inductor's C++ compiler is found (:func:`find_cxx` of :data:`INDUCTOR_CXX`):
    ``torch.compile`` of a CPU device builds its kernels with it."""
    triton: bool = True
    """``triton`` is importable: ``torch.compile`` of a CUDA device generates its kernels in Triton (inductor)."""
    host_compiler: bool = True
    """A C++ compiler (:func:`find_cxx` of :data:`CPP_EXTENSION_CXX`, as ``torch.utils.cpp_extension`` picks it)
    is found: DeepSpeed's host ops (CPU Adam/Lion, :data:`HOST_OPS`) can be JIT-built, with or without nvcc."""
    libaio: bool | None = True
    """DeepSpeed's async_io op can be built here (``AsyncIOBuilder().is_compatible()``: libaio's headers and
    library link); None: not checked yet, :func:`async_io_compatible` is asked (once a process) the first
    time an NVMe candidate needs it."""
    failed_ops: frozenset[str] = frozenset()
    """Ops whose build failed this run (:meth:`autofit.probe.ops.OpsReport.software`): not loadable, whatever
    the tools say."""
    prebuilt_ops: frozenset[str] = field(default_factory=frozenset)
    """DeepSpeed ops compiled at install time (``DS_BUILD_OPS=1``): ``fused_adam``, ``cpu_adam``, ..."""
    nvme_path: str | None = "/local_nvme"
    """Where NVMe offload swaps (``--nvme-path``, checked by :func:`check_nvme_path`); None: NVMe is pruned.
    The default is a placeholder for planning without a machine."""
    nvme_free_bytes: int | None = None
    """Free bytes on ``nvme_path``'s filesystem (``shutil.disk_usage``) when it was checked; None: not known.
    A candidate whose swap files would not fit is rejected (:func:`autofit.swap_buffers.nvme_swap_bytes`)."""
    pin_memory: bool = True
    """Whether offload buffers are page-locked: yes. DeepSpeed pins them with ``cudaHostAlloc`` (torch's
    ``pin_memory``), which ``RLIMIT_MEMLOCK`` does not bound; pinned pages are host RAM that cannot be swapped
    out, which the host model checks against the node's available RAM (:mod:`autofit.cost_model.host`)."""
    memlock_bytes: int | None = None
    """``RLIMIT_MEMLOCK``'s soft limit where it binds (not root, not unlimited), else None. It binds DeepSpeed's
    NVMe swap buffers: ``new_cpu_locked_tensor`` allocates them with ``mlock`` (csrc/pin_memory/page_alloc.cpp),
    so an NVMe candidate whose pinned swap pools pass it is rejected."""

    def can_load_op(self, op: str) -> bool:
        """Whether DeepSpeed's op ``op`` is installed pre-built or can be JIT-built here (:meth:`op_unavailable`)."""
        return self.op_unavailable(op) is None

    def op_unavailable(self, op: str) -> str | None:
        """Why DeepSpeed's op ``op`` can neither be loaded pre-built nor JIT-built here, as a clause that follows
        "DeepSpeed's <op> op" ("whose build failed", ...); None where it can. A host op (CPU Adam/Lion) builds with
        the C++ compiler, a CUDA op with nvcc, async_io also with libaio; one whose build failed never loads."""
        if op in self.failed_ops:
            return "whose build failed"
        if op in self.prebuilt_ops:
            return None
        if op in HOST_OPS:  # CPU Adam/Lion: the host compiler builds them, nvcc or not
            return None if self.host_compiler else "which is not pre-built and cannot be built without a C++ compiler"
        if not self.cuda_toolkit:
            return "which is not pre-built and cannot be built without a CUDA toolkit (nvcc)"
        if op == "async_io" and not self.has_libaio():
            return ("which needs libaio (AsyncIOBuilder().is_compatible() is False: install libaio-dev / "
                    "libaio-devel)")
        return None

    def has_libaio(self) -> bool:
        """:attr:`libaio`, checked with DeepSpeed's builder where it was not yet."""
        return self.libaio if self.libaio is not None else async_io_compatible()


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
    )


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
        import resource
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


#: ops compiled by the host's C++ compiler, nvcc or not: on the CUDA accelerator CPUAdamBuilder and CPULionBuilder
#: are the CPU accelerator's (deepspeed/accelerator/cuda_accelerator.py ``_lazy_init_class_dict``: "Host-side
#: optimizers run on the CPU"), ``CPUOpBuilder`` subclasses built as a ``CppExtension``
#: (deepspeed/ops/op_builder/cpu/builder.py)
HOST_OPS = frozenset({"cpu_adam", "cpu_lion", "cpu_adagrad", "deepspeed_shm_comm"})

#: DeepSpeed op builders by op name (deepspeed/ops/op_builder: FusedAdamBuilder.NAME == "fused_adam", ...)
OP_BUILDERS = {
    "fused_adam": "FusedAdamBuilder",
    "fused_lion": "FusedLionBuilder",
    "cpu_adam": "CPUAdamBuilder",
    "cpu_lion": "CPULionBuilder",
    "async_io": "AsyncIOBuilder",
    "deepspeed_shm_comm": "ShareMemCommBuilder",
}


def optimizer_op(optimizer: str, offload_optimizer: str, device_kind: str) -> str | None:
    """The compiled DeepSpeed op the optimizer of a config loads, or None (a torch or client optimizer).

    deepspeed/runtime/engine.py, ``_configure_basic_optimizer``: ``AdamW`` is FusedAdam (DeepSpeedCPUAdam
    with ZeRO-Offload), ``Lion`` FusedLion (DeepSpeedCPULion with offload). On a CPU device autofit passes
    Lion as a client optimizer (:mod:`autofit.optim`), so only AdamW loads an op there.
    """
    offloaded = offload_optimizer != "none"
    if optimizer == "adamw":
        return "cpu_adam" if offloaded else "fused_adam"
    if optimizer == "lion" and (offloaded or device_kind == "cuda"):
        return "cpu_lion" if offloaded else "fused_lion"
    return None


def uses_torch_adam(optimizer: str, offload_optimizer: str, device_kind: str, software: Software) -> bool:
    """AdamW runs as ``torch.optim.AdamW`` (DeepSpeed's ``torch_adam``) where FusedAdam cannot be built."""
    op = optimizer_op(optimizer, offload_optimizer, device_kind)
    return device_kind == "cuda" and op == "fused_adam" and not software.can_load_op(op)


def ops_needed(configs: list[tuple[str, str, str]], device_kind: str, software: Software) -> tuple[str, ...]:
    """The DeepSpeed ops that ``(optimizer, offload_optimizer, offload_params)`` configs load, sorted."""
    # on the CPU accelerator DeepSpeed's comm backend builds its shared-memory op at start
    # (deepspeed/comm/torch.py, build_shm_op): measured, 421 s of a probe's initialize here when unbuilt
    ops: set[str] = {"deepspeed_shm_comm"} if device_kind == "cpu" else set()
    for optimizer, offload_optimizer, offload_params in configs:
        op = optimizer_op(optimizer, offload_optimizer, device_kind)
        if op and not uses_torch_adam(optimizer, offload_optimizer, device_kind, software):
            ops.add(op)
        if "nvme" in (offload_optimizer, offload_params):
            ops.add("async_io")
    return tuple(sorted(ops))
