"""What to fit where: the request every command shares, and the setup made from it once.

A :class:`Target` is the model entry point, the device, the world size, the global batch, the search space
and the values fixed with ``--set``: the options (docs/design.md, "CLI") that every ``autofit`` command takes, as plain
typed values (what a notebook passes as well as what the command line parsed). :func:`prepare` turns it
into a :class:`Setup`: the workload loaded (or, planned from its sources, only when needed:
:mod:`autofit.trace.source_cache`), the hardware resolved with the memory budget, the space read,
``--set`` parsed, ``--hosts`` read (one a node) and the machine's software detected (``--nvme-path`` included),
each once. Nothing is passed through ``os.environ``: the setup carries every value to the plan, the probes and
the JSON.

Each field of :class:`Target` also says how the command line spells it (:func:`option`): ``autofit.cli``
makes its shared options from these fields, so an option every command takes is added here, in one line.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autofit.core.config import parse_set
from autofit.core.errors import AutofitError
from autofit.core.hardware import PRESETS, default_gpus
from autofit.core.recipe import parse_hyperparameters, recipe_for
from autofit.core.software import CUDA_CLUSTER
from autofit.core.space import load_space
from autofit.core.units import MAX_GLOBAL_BATCH, MAX_GPUS_PER_NODE, MAX_WORLD_SIZE, parse_bytes, whole
from autofit.cost_model.budget import DEFAULT_MARGIN, MAX_MARGIN, check_margin
from autofit.ds.recipe_from import read_recipe
from autofit.machine.device import cuda_devices_here, get_hardware
from autofit.machine.software import check_nvme_path, detect_software, read_software_file
from autofit.planning.plan import Plan
from autofit.probe.elastic import node_launch
from autofit.probe.nodes import check_host_count, read_hosts
from autofit.trace.source_cache import SourcePlannedWorkload, planned_workload
from autofit.workload.hf import TASKS as HF_TASKS
from autofit.workload.hf import with_hf_options

if TYPE_CHECKING:
    from autofit.core.hardware import Hardware
    from autofit.core.recipe import Recipe
    from autofit.core.software import Software
    from autofit.core.space import SearchSpace
    from autofit.planning.plan import Plan
    from autofit.trace.source_cache import SourcePlannedWorkload
    from autofit.workload.types import Workload

#: the key of a field's metadata that holds its command-line spelling (read by ``autofit.cli``)
CLI_OPTION = "autofit.cli"


def option(*flags: str, help: str, minimum: int | None = None, multiple: bool = False,
           metavar: str | None = None, show_default: bool = False, choices: tuple[str, ...] | None = None,
           is_flag: bool = False) -> dict[str, Any]:
    """A field's metadata: the command-line option that sets it (``flags``; none: the positional argument)
    and its help text. ``minimum``: the least an integer may be; ``multiple``: repeatable, a tuple of strings;
    ``choices``: the values it takes; ``is_flag``: a boolean switch. Kept free of click so the library does not
    import it; ``autofit.cli`` turns it into a click option."""
    spec = {"flags": flags, "help": help, "minimum": minimum, "multiple": multiple, "metavar": metavar,
            "show_default": show_default, "choices": choices, "is_flag": is_flag}
    return {CLI_OPTION: spec}


@dataclass(frozen=True)
class Target:
    """One request: which model, on what device and how many of them, with which space and fixed values."""

    entry: str | None = field(default=None, metadata=option(help="The model entry point, path.py:function."))
    """``path/to/file.py:function`` or ``package.module:function`` returning an :class:`autofit.Workload`;
    None in script mode (``autofit run --script``), which has no entry point."""
    hardware: str = field(default="auto", metadata=option(
        "--hardware", help=f"Preset ({', '.join(PRESETS)}), cpu, or auto.",
        show_default=True))
    """A preset name (``h100-80gb``), ``cpu`` (this machine's CPU) or ``auto`` (detect):
    :func:`autofit.machine.device.get_hardware`."""
    memory: str | int | None = field(default=None, metadata=option(
        "--memory", help="Device memory budget, e.g. 2GiB, 1.5GiB, 800MiB."))
    """The device memory budget, overriding the preset's: ``2GiB``, ``800MiB`` or bytes
    (:func:`autofit.core.units.parse_bytes`); None: the device's own."""
    margin: float = field(default=DEFAULT_MARGIN, metadata=option(
        "--margin", help=f"Share of the device memory every config must leave free: it fits when predicted within "
        f"(1 - margin) x memory, and the search's winner when measured within it (0 to {MAX_MARGIN:g}).",
        show_default=True))
    """The safety margin (:mod:`autofit.cost_model.budget`): every command judges what fits against
    ``(1 - margin) x`` the device memory, the search its measured peaks too."""
    gpus: int | None = field(default=None, metadata=option(
        "--gpus", help="Devices per node (default: the GPUs visible here with --hardware auto on a CUDA machine, "
        "else 1).", minimum=1))
    """Devices (ranks) per node; None: resolved by :func:`prepare` (:func:`autofit.core.hardware.default_gpus`), the
    visible GPUs where ``hardware`` is ``auto`` and finds CUDA, else 1."""
    nodes: int = field(default=1, metadata=option("--nodes", help="Nodes.", minimum=1, show_default=True))
    """Nodes; the world size is ``gpus x nodes``."""
    hosts: str | None = field(default=None, metadata=option(
        "--hosts", help="Probe across these nodes (ssh): a,b or a hostfile, a host a line (default: the Slurm "
        "allocation, else simulated nodes here).", metavar="HOSTS"))
    """Where a probe of several nodes runs its agents: ``a,b`` or a hostfile (:func:`autofit.probe.nodes.read_hosts`);
    None: the Slurm allocation, else nodes simulated on this machine (:mod:`autofit.probe.nodes`)."""
    global_batch: int | None = field(default=None, metadata=option(
        "--global-batch", help="Samples per optimizer step over all devices.", minimum=1))
    """Samples per optimizer step over all ranks; None: the space's own."""
    space: str | None = field(default=None, metadata=option(
        "--space", help="Search space: a name in search_spaces/ or a YAML file."))
    """A space name in ``search_spaces/`` or a YAML file (:func:`autofit.core.space.load_space`); None: the default."""
    set_values: tuple[str, ...] = field(default=(), metadata=option(
        "--set", help="Fix a dimension, e.g. --set zero_stage=2 (repeatable).", multiple=True, metavar="KEY=VALUE"))
    """``key=value`` pairs fixing config keys (:func:`autofit.core.config.parse_set`), as ``--set`` gives them."""
    nvme_path: str | None = field(default=None, metadata=option(
        "--nvme-path", help="A writable directory on an NVMe drive: NVMe offload swaps there (else it is pruned)."))
    """A writable directory on an NVMe drive where NVMe offload swaps; None: ``AUTOFIT_NVME_PATH`` where the
    user set it, else NVMe offload is pruned (:mod:`autofit.core.rules`)."""
    software: str | None = field(default=None, metadata=option(
        "--software", help="The software of the machines that will train, which the rules judge: here (this "
        "machine's), cluster (a CUDA cluster: flash-attn, triton, nvcc, libaio) or FILE (python -m "
        "autofit.machine.software > FILE there). Default: here for --hardware cpu/auto and probes here, else cluster.",
        metavar="here|cluster|FILE"))
    """What the target runs (docs/design.md, "The target's software"): ``here``, ``cluster``
    (:data:`autofit.core.software.CUDA_CLUSTER`) or a JSON file (:func:`autofit.machine.software.read_software_file`);
    None: resolved by :func:`prepare` (:func:`target_software`)."""

    seq_len: int | str | None = field(default=None, metadata=option(
        "--seq-len", help="hf: entries: tokens per sample (the encoder's for seq2seq; default for CLIP and Whisper: "
        "the config's); max: autofit estimate answers the longest that fits, with which config.", metavar="N|max"))
    """An ``hf:`` entry's tokens per sample (:func:`autofit.workload.hf.hf_workload`; None: the config's limit for a
    contrastive or speech model, :mod:`autofit.workload.hf_positions`); refused with any other entry."""
    task: str | None = field(default=None, metadata=option(
        "--task", help="hf: entries: the task (default: the config's architectures).", choices=tuple(HF_TASKS)))
    """An ``hf:`` entry's task; None: from its config's ``architectures``."""
    trust_remote_code: bool = field(default=False, metadata=option(
        "--trust-remote-code", help="hf: entries: run the model repository's own code.", is_flag=True))
    """Let an ``hf:`` entry run its repository's own code; never without the user saying so."""
    optimizer: str | None = field(default=None, metadata=option(
        "--optimizer", help="The optimizer you train with (default adamw); the search never trades it away."))
    """The recipe's optimizer (docs/recipe.md); None: AdamW, or what ``--set optimizer=`` names."""
    precision: str | None = field(default=None, metadata=option(
        "--precision", help="The precision you train in (default: bf16 on GPUs that have it, else fp16; fp32 on a CPU)."))
    """The recipe's precision; None: the device's mixed precision (:func:`autofit.core.recipe.default_precision`)."""
    allow: tuple[str, ...] = field(default=(), metadata=option(
        "--allow", help="Substitutes the search may try: adamw8bit, adam_mini, fp8, fp16, bf16, or 'near' "
        "(repeatable or comma-separated; docs/recipe.md).", multiple=True, metavar="NAMES"))
    """Substitutes that change the numerics a little, allowed by name (:func:`autofit.core.recipe.expand_allow`)."""
    recipe_from: str | None = field(default=None, metadata=option(
        "--recipe-from", help="Read the recipe (optimizer, precision, lr, ...) from your DeepSpeed JSON or "
        "TrainingArguments.to_json_string() output (docs/recipe.md).", metavar="FILE"))
    """A JSON stating the recipe (:func:`autofit.ds.recipe_from.read_recipe`); flags that disagree with it are an error."""
    lr: str | None = field(default=None, metadata=option("--lr", help="Learning rate for the JSON (default 'auto')."))
    """The recipe's learning rate; None: ``"auto"`` in the JSON (the Hugging Face Trainer fills it)."""
    weight_decay: str | None = field(default=None, metadata=option(
        "--weight-decay", help="Weight decay for the JSON (default 'auto')."))
    """The recipe's weight decay; None: ``"auto"``."""
    betas: str | None = field(default=None, metadata=option(
        "--betas", help="Adam/Lion betas for the JSON (default 'auto').", metavar="B1,B2"))
    """The recipe's betas, ``B1,B2``; None: ``"auto"``."""
    eps: str | None = field(default=None, metadata=option("--eps", help="Adam epsilon for the JSON (default 'auto')."))
    """The recipe's epsilon; None: ``"auto"``."""
    momentum: str | None = field(default=None, metadata=option(
        "--momentum", help="SGD momentum for the JSON (default: torch's)."))
    """The recipe's SGD momentum; None: left out (torch's default)."""

    def __post_init__(self) -> None:
        if self.gpus is not None:  # None: resolved by prepare, from what detection found
            whole("gpus", self.gpus, 1, MAX_GPUS_PER_NODE)
        whole("nodes", self.nodes, 1, MAX_WORLD_SIZE)
        if self.gpus is not None and self.gpus * self.nodes > MAX_WORLD_SIZE:
            raise AutofitError(f"gpus x nodes must be at most {MAX_WORLD_SIZE}, but got {self.gpus} x {self.nodes}")
        if self.global_batch is not None:
            whole("global_batch", self.global_batch, 1, MAX_GLOBAL_BATCH, or_none=True)
        object.__setattr__(self, "seq_len", _seq_len(self.seq_len))
        object.__setattr__(self, "margin", check_margin(self.margin))
        if isinstance(self.set_values, str):
            raise AutofitError(f"set_values must be a tuple of key=value strings, but got {self.set_values!r}")
        object.__setattr__(self, "set_values", tuple(self.set_values))

    @property
    def world_size(self) -> int:
        """Data-parallel ranks: ``gpus x nodes``; an :class:`AutofitError` before :func:`prepare` resolved ``gpus``."""
        if self.gpus is None:
            raise AutofitError("gpus=None is resolved by autofit.planning.target.prepare (from the detected devices); "
                               "the world size is known after it")
        return self.gpus * self.nodes

    def hyperparameter_pairs(self) -> tuple[str, ...]:
        """The optimizer hyperparameters given, as ``key=value`` (:func:`autofit.core.recipe.parse_hyperparameters`)."""
        given = {"lr": self.lr, "weight_decay": self.weight_decay, "betas": self.betas, "eps": self.eps,
                 "momentum": self.momentum}
        return tuple(f"{key}={value}" for key, value in given.items() if value is not None)

    def memory_bytes(self) -> int | None:
        """``memory`` in bytes (None: the device's own); an :class:`AutofitError` when it does not parse."""

        return parse_bytes(self.memory) if self.memory is not None else None


def cli_fields() -> tuple[dataclasses.Field[Any], ...]:
    """The fields of :class:`Target` in their command-line order (each with its :func:`option` metadata)."""
    return tuple(f for f in dataclasses.fields(Target) if CLI_OPTION in f.metadata)


@dataclass(frozen=True)
class Setup:
    """A :class:`Target` resolved once: workload, hardware, space, software and the fixed values."""

    target: Target
    """The request it was made from, with ``gpus`` resolved (never None) and an ``hf:`` entry's options folded
    into it."""
    hardware: Hardware
    """The device with the memory budget, ``devices_per_node`` = ``target.gpus``."""
    space: SearchSpace
    """The search space, read and validated."""
    software: Software
    """What the target runs (:func:`target_software`; its ``source`` says which): this machine's with ``--nvme-path``
    checked (:func:`autofit.machine.software.check_nvme_path`), or the cluster's or a file's, taken as stated."""
    fixed: dict[str, Any]
    """``--set``, parsed: config key to value."""
    workload: Workload | SourcePlannedWorkload | None
    """The entry point's workload, or what plans read of it (:func:`autofit.trace.source_cache.planned_workload`:
    the entry is imported only when something needs more); None in script mode."""
    recipe: Recipe
    """The user's training recipe (:mod:`autofit.core.recipe`): what the search keeps and the JSON carries."""
    hosts: tuple[str, ...] = ()
    """``--hosts``, read once (:func:`autofit.probe.nodes.read_hosts`), one a node; empty when not given."""

    @property
    def entry(self) -> str | None:
        """The entry point as given; None in script mode."""
        return self.target.entry

    @property
    def world_size(self) -> int:
        """Data-parallel ranks: ``gpus x nodes``."""
        return self.gpus * self.nodes

    @property
    def gpus(self) -> int:
        """Devices (ranks) per node, as given or as detection found (:func:`autofit.core.hardware.default_gpus`)."""
        return self.hardware.devices_per_node

    @property
    def nodes(self) -> int:
        """Nodes the ranks span."""
        return self.target.nodes

    @property
    def global_batch(self) -> int | None:
        """Samples per optimizer step over all ranks; None: the space's own."""
        return self.target.global_batch

    @property
    def entry_point(self) -> str:
        """ENTRY; an :class:`AutofitError` in script mode, which has none."""
        if self.target.entry is None:
            raise AutofitError("this needs an ENTRY (a model entry point); script mode (--script) has none")
        return self.target.entry

    @property
    def planning_workload(self) -> Workload | SourcePlannedWorkload:
        """What a plan reads of ENTRY's workload (:attr:`workload`); an :class:`AutofitError` in script mode."""
        if self.workload is None:
            raise AutofitError("this needs an ENTRY (a model entry point); script mode (--script) has none")
        return self.workload

    @property
    def loaded_workload(self) -> Workload:
        """ENTRY's workload, loaded; an :class:`AutofitError` in script mode, which has none."""

        workload = self.planning_workload
        return workload.workload if isinstance(workload, SourcePlannedWorkload) else workload

    def tracing_note(self) -> str:
        """What the plan's first step does, in words: the trace, and on a CPU device the kernels' footprint
        (:mod:`autofit.probe.footprint`), which takes a few seconds a precision."""
        measured = " and measuring what its kernels hold on this CPU" if self.hardware.kind == "cpu" else ""
        return f"tracing {self.planning_workload.name or self.entry_point}{measured}"

    def check_nodes(self) -> None:
        """Where the probes of several nodes cannot run here, one line before anything is traced or probed
        (:func:`autofit.probe.elastic.node_launch`)."""
        n_nodes = self.hardware.n_nodes(self.world_size)
        if n_nodes > 1:

            node_launch(self.hardware.kind, n_nodes, self.hardware.ranks_on_a_node(self.world_size), self.hosts)

    def plan(self) -> Plan:
        """Trace the workload and enumerate the space's candidates (:meth:`autofit.planning.plan.Plan.make`)."""

        return Plan.make(self.entry_point, self.planning_workload, self.hardware, self.space,
                         world_size=self.world_size, global_batch=self.global_batch, fixed=self.fixed,
                         software=self.software, recipe=self.recipe, hosts=self.hosts, margin=self.target.margin)


def _seq_len(value: int | str | None) -> int | str | None:
    """``--seq-len``: an integer >= 1, ``max`` (:mod:`autofit.planning.longest`) or None."""
    if value is None or value == "max":
        return value
    text = str(value).strip().lower()
    if text == "max":
        return "max"
    if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
        raise AutofitError(f"seq_len must be an integer >= 1 or max, but got seq_len={value!r}")
    return int(text)


def prepare(target: Target, workload: Workload | None = None, *, probes_here: bool = False) -> Setup:
    """Resolve ``target`` once: parse ``--set``, resolve the hardware and its budget and ``gpus`` (None: from
    detection, :func:`autofit.core.hardware.default_gpus`), read the space and ``--hosts`` (one a node), resolve the
    target's software (:func:`target_software`) with ``--nvme-path``, load the workload
    (:func:`autofit.trace.source_cache.planned_workload`: not where a record of its sources answers).
    Any bad value is one :class:`AutofitError` naming it.

    ``workload``: a :class:`Workload` object to use instead of loading ``target.entry`` (the Python API's, which
    then names it with :func:`autofit.workload.entry.in_process_entry`; nothing but this process can load it).
    ``probes_here``: the command runs its probes on this machine (``autofit probe``, ``run``, ``ladder --measure``):
    without ``--hosts`` they are judged by this machine's software, whatever the hardware."""

    if isinstance(target.seq_len, str):  # "max", the one word a length takes
        raise AutofitError("--seq-len max is a question autofit estimate answers (the longest sequence that fits); "
                           "give the other commands a length")
    if target.entry is not None:  # the hf: options travel inside the entry string, to the probes too
        target = dataclasses.replace(target, entry=with_hf_options(
            target.entry, seq_len=target.seq_len, task=target.task, trust_remote_code=target.trust_remote_code))
    fixed = parse_set(target.set_values)
    hosts = read_hosts(target.hosts) if target.hosts is not None else ()
    if hosts:  # before the trace: a probe would refuse them only once it starts
        check_host_count(hosts, target.nodes)
    hardware = get_hardware(target.hardware, target.memory_bytes())
    space = load_space(target.space)
    software = target_software(target, probes_here=probes_here and not hosts)
    # counted only where it can decide (default_gpus): a preset on a machine without CUDA must not import torch
    auto_cuda = target.gpus is None and target.hardware.lower() == "auto" and hardware.kind == "cuda"
    detected = cuda_devices_here() if auto_cuda else None
    gpus = default_gpus(target.gpus, target.hardware, hardware.kind, detected)
    target = dataclasses.replace(target, gpus=gpus)
    # --gpus ranks share each node's host memory and links (cost_model.host, cost_model.time)
    hardware = dataclasses.replace(hardware, devices_per_node=gpus)
    read = read_recipe(target.recipe_from) if target.recipe_from is not None else None
    recipe = recipe_for(fixed, hardware.kind, hardware.supports_precision("bf16"), optimizer=target.optimizer,
                        precision=target.precision, allow=target.allow,
                        hyperparameters=parse_hyperparameters(target.hyperparameter_pairs()), read=read)
    planned = planned_workload(target.entry) if workload is None and target.entry is not None else workload
    return Setup(target=target, hardware=hardware, space=space, software=software, fixed=fixed, workload=planned,
                 recipe=recipe, hosts=hosts)


def target_software(target: Target, *, probes_here: bool) -> Software:
    """The software the rules judge (docs/design.md, "The target's software"): ``--software here`` is this machine's
    (:func:`machine_software`), ``cluster`` :data:`autofit.core.software.CUDA_CLUSTER`, any other value a JSON file
    (:func:`autofit.machine.software.read_software_file`). Left out: ``here`` where the probes run here or the
    hardware is this machine's (``cpu``, ``auto``) and no ``--hosts`` names others, else ``cluster``. A probe here
    with another machine's software is one :class:`AutofitError`: what runs here is judged here."""
    choice = target.software
    if choice is None:
        here = probes_here or (target.hardware.lower() in ("cpu", "auto") and target.hosts is None)
        choice = "here" if here else "cluster"
    if choice == "here":
        return machine_software(target.nvme_path)
    if probes_here:
        raise AutofitError(f"--software {choice}: this command probes on this machine, whose own software judges "
                           "what can run here (--software here); another machine's is for plans of it (estimate, "
                           "ladder, schedule add) and probes on --hosts")
    stated = CUDA_CLUSTER if choice == "cluster" else read_software_file(choice)
    if target.nvme_path is None:
        return stated
    if not target.nvme_path.startswith("/"):  # a directory on the target: not checked here
        raise AutofitError(f"--nvme-path {target.nvme_path!r}: on another machine's software (--software "
                           f"{choice}) it is a directory there, and must be an absolute path")
    return dataclasses.replace(stated, nvme_path=target.nvme_path, nvme_free_bytes=None)


def machine_software(nvme_path: str | None) -> Software:
    """This machine's software (:func:`autofit.machine.software.detect_software`), with ``nvme_path`` checked and put in
    where given, with its filesystem's free space (NVMe candidates whose swap files outgrow it are rejected): the
    rules, the DeepSpeed JSONs and the probes get it from the setup, not the environment."""

    software = detect_software()
    if nvme_path is None:
        return software
    checked = check_nvme_path(nvme_path)
    return dataclasses.replace(software, nvme_path=checked, nvme_free_bytes=shutil.disk_usage(checked).free)
