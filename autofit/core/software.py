"""What this machine's software can run: the optional libraries and DeepSpeed's compiled ops.

The search-space rules (:mod:`autofit.core.rules`) prune by it (fp8 without torchao, flash without
flash-attn, a DeepSpeed op that can neither be loaded nor built) and :mod:`autofit.ds.emit` picks
DeepSpeed's ``torch_adam`` where FusedAdam cannot be built. Detection imports nothing heavy:
packages are looked up with ``importlib.util.find_spec`` and DeepSpeed's list of pre-built ops is
read from the file its ``setup.py`` writes (``deepspeed/git_version_info_installed.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from autofit.core.errors import AutofitError


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
    library link); None: not checked yet, :attr:`libaio_check` is asked the first time an NVMe candidate needs it."""
    libaio_check: Callable[[], bool] | None = field(default=None, compare=False, repr=False)
    """How to check :attr:`libaio` where it is None (detection sets
    :func:`autofit.machine.software.async_io_compatible`, which builds nothing and is cached); None: assume it can."""
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
    A candidate whose swap files would not fit is rejected (:func:`autofit.ds.swap_buffers.nvme_swap_bytes`)."""
    pin_memory: bool = True
    """Whether offload buffers are page-locked: yes. DeepSpeed pins them with ``cudaHostAlloc`` (torch's
    ``pin_memory``), which ``RLIMIT_MEMLOCK`` does not bound; pinned pages are host RAM that cannot be swapped
    out, which the host model checks against the node's available RAM (:mod:`autofit.cost_model.host`)."""
    memlock_bytes: int | None = None
    """``RLIMIT_MEMLOCK``'s soft limit where it binds (not root, not unlimited), else None. It binds DeepSpeed's
    NVMe swap buffers: ``new_cpu_locked_tensor`` allocates them with ``mlock`` (csrc/pin_memory/page_alloc.cpp),
    so an NVMe candidate whose pinned swap pools pass it is rejected."""
    source: str = "defaults"
    """Where these facts come from (docs/design.md, "The target's software"): ``here`` (detected on the machine that
    planned), ``cluster`` (:data:`CUDA_CLUSTER`, autofit's profile of a CUDA training cluster), the path of a
    ``--software FILE``, or ``defaults`` (made by hand: everything claimed)."""

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
        if self.libaio is not None:
            return self.libaio
        return self.libaio_check() if self.libaio_check is not None else True

    def to_dict(self) -> dict[str, Any]:
        """What was assumed of the target's software, as JSON (``autofit estimate --json``'s ``software``, the
        emitted JSON's ``autofit.software``); ``libaio`` is null where it was not checked (yet)."""
        values: dict[str, Any] = {"source": self.source}
        for name in SERIALIZED:
            value = getattr(self, name)
            values[name] = sorted(value) if isinstance(value, frozenset) else value
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], base: Software, source: str) -> Software:
        """``base`` with the keys of ``values`` (:meth:`to_dict`'s) put in, each checked; an unknown key or a value of
        the wrong type is one :class:`AutofitError` naming it (``source``: where ``values`` came from)."""
        changes: dict[str, Any] = {}
        for key, value in values.items():
            if key == "source":
                continue
            if key not in SERIALIZED:
                raise AutofitError(f"{source}: unknown software key {key!r} (known: {', '.join(SERIALIZED)})")
            changes[key] = _checked_value(key, value, source)
        return replace(base, **changes, source=source)

    def summary(self) -> str:
        """One line of what a plan assumed: where the facts come from, what the rules need that is there and what is
        not (the report's ``software:`` line)."""
        has = [label for name, label in FEATURES if getattr(self, name)]
        lacks = [label for name, label in FEATURES if not getattr(self, name)]
        if self.libaio is False:
            lacks.append("libaio")
        elif self.libaio:
            has.append("libaio")
        origin = SOURCES.get(self.source, f"from {self.source}")
        parts = [f"{self.source} ({origin})", f"has {', '.join(has) or 'none of the optional tools'}"]
        if lacks:
            parts.append(f"lacks {', '.join(lacks)}")
        parts.append(f"NVMe swap {self.nvme_path}" if self.nvme_path else "no NVMe path (--nvme-path)")
        return "; ".join(parts)


def _checked_value(key: str, value: Any, source: str) -> Any:
    """One :meth:`Software.from_dict` value, as its field takes it."""
    if key in ("failed_ops", "prebuilt_ops"):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise AutofitError(f"{source}: {key} must be a list of op names, but got {key}={value!r}")
        return frozenset(value)
    if key == "nvme_path":
        if value is not None and not isinstance(value, str):
            raise AutofitError(f"{source}: nvme_path must be a path or null, but got nvme_path={value!r}")
        return value
    if key in ("nvme_free_bytes", "memlock_bytes"):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise AutofitError(f"{source}: {key} must be bytes (an integer >= 0) or null, but got {key}={value!r}")
        return value
    if not isinstance(value, bool) and not (key == "libaio" and value is None):
        raise AutofitError(f"{source}: {key} must be true or false, but got {key}={value!r}")
    return value


#: the fields :meth:`Software.to_dict` writes and a ``--software FILE`` may state (``libaio_check`` is a function)
SERIALIZED = tuple(f.name for f in fields(Software) if f.name not in ("libaio_check", "source"))

#: what the rules need, as the report names it: (field, label)
FEATURES = (("flash_attn", "flash-attn"), ("triton", "triton"), ("cuda_toolkit", "nvcc"), ("torchao", "torchao"),
            ("adam_mini", "adam-mini"), ("host_compiler", "C++ compiler"))

#: :attr:`Software.source`, in words
SOURCES = {"here": "detected on this machine", "cluster": "autofit's CUDA-cluster profile",
           "defaults": "everything claimed"}

#: a CUDA training cluster's software, what ``--software cluster`` (the default for a preset, ``--hosts`` or a
#: queue's workers) assumes: PyTorch's CUDA wheels bring triton (inductor); the NGC PyTorch containers and
#: DeepSpeed's images have flash-attn, nvcc (CUDA ops JIT-built) and libaio (async_io); torchao and adam-mini are
#: pip installs and only reach a plan through ``--allow``. No op is pre-built (``pip install deepspeed`` builds none);
#: NVMe needs ``--nvme-path``, the target's directory (not checked here). ``memlock``: root in a container, unbound.
CUDA_CLUSTER = Software(
    torchao=True, flash_attn=True, adam_mini=True, cuda_toolkit=True, cxx_compiler=True, triton=True,
    host_compiler=True, libaio=True, prebuilt_ops=frozenset(), nvme_path=None, memlock_bytes=None, source="cluster",
)


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
    Lion as a client optimizer (:mod:`autofit.ds.optim`), so only AdamW loads an op there.
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


def ops_needed(configs: Sequence[tuple[str, str, str]], device_kind: str, software: Software) -> tuple[str, ...]:
    """The DeepSpeed ops that ``(optimizer, offload_optimizer, offload_params)`` configs load, sorted."""
    # on the CPU accelerator DeepSpeed's comm backend builds its shared-memory op at start
    # (deepspeed/comm/torch.py, build_shm_op): unbuilt, it took 421 s of a measured probe's initialize
    ops: set[str] = {"deepspeed_shm_comm"} if device_kind == "cpu" else set()
    for optimizer, offload_optimizer, offload_params in configs:
        op = optimizer_op(optimizer, offload_optimizer, device_kind)
        if op and not uses_torch_adam(optimizer, offload_optimizer, device_kind, software):
            ops.add(op)
        if "nvme" in (offload_optimizer, offload_params):
            ops.add("async_io")
    return tuple(sorted(ops))


def deepspeed_arch_list(arch_list: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` as DeepSpeed's op builder can read it: each architecture-specific target
    (``9.0a``, ``10.0f``: PyTorch builds ``sm_90a`` for it) as its family's (``9.0``), the rest as it was; None
    where it needs no change (unset, or already readable).

    DeepSpeed's JIT builder parses every token as ``major.minor[+PTX]`` with ``int()``
    (``CUDAOpBuilder.compute_capability_args``, deepspeed/ops/op_builder/builder.py, 0.19), so ``9.0a``, which
    CUDA images for Hopper set, fails FusedAdam's build with "invalid literal for int() with base 10: '0a'"
    (seen on an H100 with PyTorch 2.11+cu130). DeepSpeed's ops use no architecture-specific instruction, so the
    family target builds the same kernels.
    """
    if not arch_list or not arch_list.strip():
        return None
    tokens = [t for t in arch_list.replace(" ", ";").split(";") if t]
    readable = []
    for token in tokens:
        arch, plus, ptx = token.partition("+")
        major, dot, minor = arch.partition(".")
        readable.append(f"{major}{dot}{minor.rstrip('abcdefghijklmnopqrstuvwxyz')}{plus}{ptx}")
    readable = list(dict.fromkeys(readable))
    return ";".join(readable) if readable != tokens else None
