"""Fingerprints: what a cached result depends on, so a changed input makes a new search.

- :func:`workload_fingerprint`: the model's structure (its module tree and every parameter's name,
  shape and dtype, built on the ``meta`` device so nothing is allocated), the shapes and dtypes of a
  one-sample batch, ``tokens_per_sample``, and the bytes of the entry's source file and of every local
  module it imports (:func:`local_sources`: the import closure of the entry file among the files under its
  folder, read from the source, so the add and the worker compute the same one). Editing the model file, a
  sibling module it imports, or a model that builds differently, changes it.
- :class:`MachineFingerprint`: the device model, its memory, the device count, the interconnect, the
  NVIDIA driver, the CUDA runtime torch was built with, NCCL and cuDNN (where CUDA), the versions of Python,
  torch, DeepSpeed, transformers, flash-attn, triton and autofit, and ``PYTORCH_CUDA_ALLOC_CONF`` (it changes
  the allocator, so the peaks). A worker detects its own (:func:`detect_machine`); any of these changing
  changes :meth:`MachineFingerprint.key`.
- :func:`request_hash`: the space, world size, global batch, ``--set`` values, memory budget and trials.

Nothing here imports torch at module level; :func:`workload_fingerprint` does, when called.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from autofit.errors import AutofitError
from autofit.hardware import PRESETS, Hardware


def digest(value: Any) -> str:
    """sha256 of ``value`` as canonical JSON (sorted keys; anything else by ``str``)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def entry_source(entry: str) -> Path | None:
    """The source file ``entry`` (``path.py:fn`` or ``package.module:fn``) is defined in, if it has one; an ``hf:``
    entry's ``config.json`` where it is a local folder (a Hub model's config is its structure's)."""
    if entry.startswith("hf:"):
        from autofit.hf import HfEntry

        config = Path(HfEntry.parse(entry).source).expanduser() / "config.json"
        return config.resolve() if config.is_file() else None
    target = entry.rpartition(":")[0]
    if target.endswith(".py") or "/" in target:
        path = Path(target).resolve()
        return path if path.is_file() else None
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and Path(spec.origin).is_file() else None


def structure(workload: Any) -> dict[str, Any]:
    """The workload's structure, built on the meta device: module tree, parameters, a sample's shapes."""
    import torch

    with torch.device("meta"):
        model = workload.build_model()
    params = [[name, list(p.shape), str(p.dtype)] for name, p in model.named_parameters()]
    batch = workload.batch(1)
    leaves = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else [batch]
    shapes = [[list(t.shape), str(t.dtype)] if isinstance(t, torch.Tensor) else repr(t) for t in leaves]
    return {"modules": repr(model), "params": params, "batch": shapes, "tokens_per_sample": workload.tokens_per_sample}


def import_root(entry: str, source: Path) -> tuple[Path, Path]:
    """``(root, scope)``: the folder the entry's own imports resolve against and the folder whose files count
    as local. A ``path.py`` entry: its folder, both (the loader puts it on ``sys.path``). A ``package.module``
    entry: the ``sys.path`` folder holding its top package, and that package's folder (not the site-packages
    beside it: installed libraries are in the machine's fingerprint by version)."""
    if entry.startswith("hf:"):  # a local folder's config.json: the file itself, it imports nothing
        return source.parent, source
    target = entry.rpartition(":")[0]
    if target.endswith(".py") or "/" in target:
        return source.parent, source.parent
    depth = target.count(".") + (1 if source.name == "__init__.py" else 0)
    root = source.parents[depth]
    return root, root / target.split(".")[0] if depth else source


def _module_files(root: Path, dotted: str) -> list[Path]:
    """The files under ``root`` that importing ``dotted`` runs: each package's ``__init__.py`` and the module."""
    parts = [p for p in dotted.split(".") if p]
    files = []
    for n in range(1, len(parts) + 1):
        folder = root.joinpath(*parts[:n])
        for candidate in (folder / "__init__.py", folder.with_suffix(".py")):
            if candidate.is_file():
                files.append(candidate)
                break
    return files


def _imported_names(path: Path, root: Path) -> list[tuple[Path, str]]:
    """``(base folder, dotted module)`` of each import in ``path`` (``from m import x`` names ``m`` and ``m.x``,
    ``x`` may be a submodule); relative imports resolve from the file's own package."""
    import ast

    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return []
    names: list[tuple[Path, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(root, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = root if node.level == 0 else path.parents[node.level - 1]
            module = node.module or ""
            names.append((base, module))
            names += [(base, f"{module}.{alias.name}" if module else alias.name) for alias in node.names]
    return names


def local_sources(source: Path, root: Path, scope: Path | None = None) -> dict[str, str]:
    """sha256 of ``source`` and of every file under ``scope`` (default ``root``) it imports, directly or through
    another such file (imports resolved against ``root``), by path relative to ``root``. Read from the source
    (``ast``), not from ``sys.modules``: what else a process happens to have imported must not change the key."""
    root = root.resolve()
    scope = (scope or root).resolve()
    seen: dict[Path, str] = {}
    pending = [source.resolve()]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen[path] = hashlib.sha256(path.read_bytes()).hexdigest()
        if path.suffix != ".py":
            continue
        for base, dotted in _imported_names(path, root):
            pending += [f.resolve() for f in _module_files(base, dotted) if f.resolve().is_relative_to(scope)]
    return {str(p.relative_to(root)) if p.is_relative_to(root) else str(p): h for p, h in sorted(seen.items())}


def workload_fingerprint(entry: str, workload: Any) -> str:
    """Hash of the workload's :func:`structure`, its entry file's bytes and the local modules it imports."""
    source = entry_source(entry)
    code = local_sources(source, *import_root(entry, source)) if source is not None else None
    return digest({"structure": structure(workload), "source": code})[:16]


def request_hash(request: dict[str, Any]) -> str:
    """Hash of what is asked of the search besides the model and the machine (space, batch, --set, trials)."""
    return digest({k: request[k] for k in sorted(request) if k not in ("entry", "hardware")})[:16]


@dataclass(frozen=True)
class MachineFingerprint:
    """One worker's machine, as far as a measured result depends on it."""

    device: str
    """Preset name of the device (``h100-80gb``, ``l4``, ``cpu``): what searches are queued for."""
    model: str
    """The device's own name (``NVIDIA H100 80GB HBM3``; the CPU's model name)."""
    memory_bytes: int
    """Memory of one device."""
    n_devices: int
    """Devices on this node."""
    interconnect: str
    """``nvlink``, ``pcie`` or ``none`` (a CPU)."""
    driver: str | None
    """NVIDIA driver version (NVML), None without one."""
    cuda: str | None
    """CUDA version torch was built with (``torch.version.cuda``)."""
    torch: str | None
    """torch's version."""
    deepspeed: str | None
    """DeepSpeed's version."""
    software: dict[str, str | None] = field(default_factory=dict)
    """Everything else a measurement depends on (:func:`software_versions`): Python, transformers, flash-attn,
    triton, autofit, NCCL, cuDNN, ``PYTORCH_CUDA_ALLOC_CONF``."""

    def key(self) -> str:
        """What the cache compares: everything but the device count (a search names the devices it uses)."""
        return digest({k: v for k, v in asdict(self).items() if k != "n_devices"})[:16]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"key": self.key()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MachineFingerprint:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def device_name(hardware: Hardware) -> str:
    """The preset a detected device matches (``h100-80gb (NVIDIA H100 80GB HBM3)`` -> ``h100-80gb``)."""
    head = hardware.name.split(" ")[0]
    return head if head in PRESETS or head == "cpu" else hardware.name


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_machine(hardware: Hardware, n_devices: int | None = None) -> MachineFingerprint:
    """This machine's fingerprint for ``hardware`` (a preset or detected device); NVML where there is CUDA."""
    nvml = _nvml_facts() if hardware.kind == "cuda" else None
    torch_version = package_version("torch")
    return MachineFingerprint(
        device=device_name(hardware),
        model=nvml["model"] if nvml else _cpu_model() if hardware.kind == "cpu" else hardware.name,
        memory_bytes=nvml["memory_bytes"] if nvml else hardware.memory_bytes,
        n_devices=n_devices or (nvml["count"] if nvml else 1),
        interconnect=nvml["interconnect"] if nvml else ("none" if hardware.kind == "cpu" else "unknown"),
        driver=nvml["driver"] if nvml else None,
        cuda=_torch_cuda() if hardware.kind == "cuda" and torch_version else None,
        torch=torch_version,
        deepspeed=package_version("deepspeed"),
        software=software_versions(cuda=hardware.kind == "cuda" and torch_version is not None),
    )


def software_versions(cuda: bool) -> dict[str, str | None]:
    """The versions beyond torch's and DeepSpeed's that change a measured result (None: not installed), NCCL's
    (``torch.cuda.nccl.version``) and cuDNN's (``torch.backends.cudnn.version``) where ``cuda``, and the CUDA
    caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF``: expandable segments change the peaks)."""
    import os
    import platform

    out: dict[str, str | None] = {
        "python": platform.python_version(),
        **{name: package_version(name) for name in ("transformers", "flash-attn", "triton", "autofit")},
        "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    if cuda:
        out |= _cuda_libraries()
    return out


def _cuda_libraries() -> dict[str, str | None]:
    import torch

    def attempt(read: Any) -> str | None:
        try:
            value = read()
        except Exception:  # no NCCL / cuDNN in this build
            return None
        return ".".join(map(str, value)) if isinstance(value, tuple) else None if value is None else str(value)

    return {"nccl": attempt(torch.cuda.nccl.version), "cudnn": attempt(torch.backends.cudnn.version)}


def _nvml_facts() -> dict[str, Any] | None:
    """Device 0's name, memory, the count, the driver and whether NVLink is up, from NVML (None without it)."""
    try:
        import pynvml  # nvidia-ml-py, the 'cuda' extra
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
        return {
            "model": name.decode() if isinstance(name, bytes) else name,
            "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
            "count": int(pynvml.nvmlDeviceGetCount()),
            "driver": driver.decode() if isinstance(driver, bytes) else driver,
            "interconnect": "nvlink" if _nvlink_up(pynvml, handle) else "pcie",
        }
    finally:
        pynvml.nvmlShutdown()


def _nvlink_up(pynvml: Any, handle: Any) -> bool:
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                return True
        except pynvml.NVMLError:
            return False
    return False


def _torch_cuda() -> str | None:
    import torch

    return torch.version.cuda


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def worker_name() -> str:
    """``host-pid-random``: who holds a search, as ``autofit schedule list`` shows it. The random part keeps it
    unique where host and pid repeat (containers: every worker is pid 1 of a pod named alike)."""
    import os
    import uuid

    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def check_device_name(name: str) -> str:
    """A hardware name a search may be queued for: a preset or ``cpu``."""
    key = name.lower()
    if key not in PRESETS and key != "cpu":
        raise AutofitError(f"a search is queued for a preset or cpu, but got hardware {name!r}; known: "
                           f"{', '.join((*PRESETS, 'cpu'))}")
    return key
