"""Where the nodes of a multi-node probe run, and the command that starts each node's agent.

A probe of ``--nodes N --gpus G`` runs one agent per node (:mod:`autofit.probe.rank.agent`: PyTorch's elastic
launcher, ``torch.distributed.launcher.api.elastic_launch``, with a c10d rendezvous), each starting its G
ranks. :func:`plan_nodes` picks, in this order:

1. ``--hosts a,b`` (or a hostfile): the agent runs on each host through ``ssh -o BatchMode=yes`` (a host that
   is this machine runs it directly); the rendezvous store is on the first host, at the name given, which every
   node must reach: a list that mixes a loopback name (``localhost``, ``127.0.0.1``) with remote hosts is
   refused (:func:`check_reachable`).
2. A Slurm allocation (``SLURM_JOB_ID`` and ``SLURM_JOB_NODELIST``) of at least N nodes: one ``srun`` step
   of N tasks, one per node (``--ntasks-per-node=1``), each the agent; the store is on the allocation's first
   node (where ``sbatch`` runs its script, and autofit with it). No ssh.
3. This machine, N simulated nodes over loopback: on CUDA node k sees GPUs ``k*G .. k*G+G-1`` only
   (``CUDA_VISIBLE_DEVICES``), so N x G GPUs must be visible; on the CPU the nodes share the cores.

Where none applies (CUDA, fewer than N x G GPUs here, no allocation and no hosts) :func:`plan_nodes` raises
one line: nothing is probed, and ``autofit estimate`` still plans.

The agent reads the probe's spec on its stdin and writes its ranks' results on its stdout, so no node needs
a filesystem shared with this one; it ends its ranks when its stdin closes (the probe ended or this process
died), through ssh and srun alike. Every node must have this Python at the same path (a shared virtual
environment, or one installed the same on each) and this autofit on its ``PYTHONPATH``.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from autofit.core.errors import AutofitError

#: the environment a remote agent is given through ssh (srun exports the whole environment by itself)
FORWARDED_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "DS_", "AUTOFIT_", "HF_")
FORWARDED = ("PYTHONPATH", "OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "LD_LIBRARY_PATH", "PATH")
#: names of this machine's loopback interface (``/etc/hosts``); any ``127.0.0.0/8`` or ``::1`` address is one too
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


@dataclass(frozen=True)
class NodeCommand:
    """One process this machine starts for a probe: an agent, or ``srun``/``ssh`` starting agents elsewhere."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    """Variables set on top of this process's environment for that process."""


@dataclass(frozen=True)
class NodeLaunch:
    """How the N agents of a probe start: ``local``, ``slurm`` or ``hosts``, and the processes to start."""

    how: str
    commands: tuple[NodeCommand, ...]
    endpoint: str
    """The c10d rendezvous store, ``host:port``."""


def agent_argv(python: str, n_nodes: int, ranks_per_node: int, endpoint: str, run_id: str, ranks_on_host: int,
               is_host: bool | None = None) -> tuple[str, ...]:
    """The agent's command line (:mod:`autofit.probe.rank.agent`); ``is_host`` None: torch decides by host name."""
    argv = [python, "-m", "autofit.probe.rank.agent", f"--nnodes={n_nodes}", f"--nproc-per-node={ranks_per_node}",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", f"--ranks-on-host={ranks_on_host}"]
    if is_host is not None:
        argv.append(f"--is-host={int(is_host)}")
    return tuple(argv)


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (``gpu-[01-03,7],login1``) as host names, in order (``scontrol show
    hostnames``; zero padding kept). One bracket group a name."""
    hosts: list[str] = []
    for prefix, ranges, suffix in re.findall(r"([^,\[\]]*)(?:\[([^\]]*)\])?([^,\[\]]*)", nodelist):
        if not prefix and not ranges and not suffix:
            continue
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise AutofitError(f"cannot read the Slurm host list {nodelist!r} (range {part!r})")
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{len(low)}d}{suffix}")
    return hosts


def slurm_hosts(environ: Mapping[str, str]) -> list[str] | None:
    """The nodes of the Slurm allocation this process runs in, or None outside one."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not environ.get("SLURM_JOB_ID") or not nodelist:
        return None
    return expand_nodelist(nodelist)


def read_hosts(value: str) -> tuple[str, ...]:
    """``--hosts``: ``a,b,c``, or a hostfile (a host a line, DeepSpeed's ``host slots=N`` read as the host;
    ``#`` starts a comment). An empty list, an unreadable hostfile or a name ssh would misread (:func:`check_host`)
    is one line of error."""
    path = Path(value)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise AutofitError(f"--hosts: cannot read the hostfile {value} ({type(exc).__name__}: {exc}); "
                               "give a,b or a text file with a host a line") from None
        lines = [line.split("#", 1)[0].split() for line in text.splitlines()]
        hosts = tuple(words[0] for words in lines if words)
    else:
        hosts = tuple(h.strip() for h in value.split(",") if h.strip())
    if not hosts:
        raise AutofitError(f"--hosts {value!r} names no host (give a,b or a hostfile with a host a line)")
    for host in hosts:
        check_host(host)
    return hosts


def check_host(host: str) -> None:
    """One line for a host name ssh would not read as one host: one starting with ``-`` (an ssh option, e.g.
    ``-oProxyCommand=...``) or holding whitespace or control characters."""
    if host.startswith("-") or any(c.isspace() or not c.isprintable() for c in host):
        raise AutofitError(f"--hosts: {host!r} is not a host name (it starts with '-' or holds whitespace or "
                           "control characters)")


def check_host_count(hosts: tuple[str, ...], n_nodes: int) -> None:
    """One line unless ``hosts`` (``--hosts``, read) names one host per node."""
    if len(hosts) != n_nodes:
        raise AutofitError(f"--hosts names {len(hosts)} host(s) ({', '.join(hosts)}) for --nodes {n_nodes}; "
                           "give one host per node")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface, which no other machine reaches by that name."""

    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_reachable(hosts: tuple[str, ...], this_host: str) -> None:
    """One line where ``hosts`` mix loopback names with remote hosts. The rendezvous store's address is the
    first host's name as given, and each remote node must reach every node: a loopback name there points a
    remote agent at itself, whose rendezvous then waits for nodes that never come (until the probe's
    deadline). Replacing it with this machine's host name would not be safe either: that name may resolve to
    a loopback address (Debian's ``/etc/hosts`` maps it to ``127.0.1.1``) or not at all on the other nodes, the
    same silent wait. So the user names this machine as the other nodes reach it."""
    loopback = [host for host in hosts if is_loopback(host)]
    remote = [host for host in hosts if not is_loopback(host) and host != this_host]
    if loopback and remote:
        raise AutofitError(f"--hosts mixes {loopback[0]!r}, a loopback name, with remote host {remote[0]!r}, "
                           f"which cannot reach this machine by it; name this machine as the other nodes reach "
                           f"it (e.g. {this_host!r})")


def device_slices(visible: list[str], n_nodes: int, ranks_per_node: int) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of each simulated node: node k gets entries ``k*G .. k*G+G-1`` of ``visible``."""
    return [",".join(visible[k * ranks_per_node:(k + 1) * ranks_per_node]) for k in range(n_nodes)]


def plan_nodes(
    kind: str, n_nodes: int, ranks_per_node: int, *, environ: Mapping[str, str], hosts: tuple[str, ...],
    visible_devices: list[str] | None, python: str, cwd: str, port: int, run_id: str, this_host: str,
    which: Callable[[str], str | None],
) -> NodeLaunch:
    """The agents of an ``n_nodes`` x ``ranks_per_node`` probe: ``--hosts``, else the Slurm allocation, else
    simulated nodes here (module docstring); an :class:`AutofitError` line where none can run it.

    ``visible_devices``: the CUDA devices this process sees (``CUDA_VISIBLE_DEVICES`` entries, else NVML's
    indices; None: unknown); ``which``: :func:`shutil.which`; ``this_host``: :func:`socket.gethostname`;
    ``environ``'s ``PYTHONPATH`` goes to every agent (it must import this autofit)."""
    shape = f"--nodes {n_nodes} x --gpus {ranks_per_node}"
    # the agent imports this autofit wherever it runs (ssh forwards it: remote_command)
    carried = {"PYTHONPATH": environ["PYTHONPATH"]} if environ.get("PYTHONPATH") else {}
    if hosts:
        return _on_hosts(hosts, n_nodes, ranks_per_node, environ, carried, python, cwd, port, run_id, this_host,
                         which, shape)
    allocation = slurm_hosts(environ)
    if allocation is not None and len(allocation) >= n_nodes > 1:
        if which("srun") is None:
            raise AutofitError(f"{shape}: this is Slurm job {environ.get('SLURM_JOB_ID')} but srun is not on PATH; "
                               "no probe across nodes (autofit estimate plans without one)")
        endpoint = f"{allocation[0]}:{port}"
        srun = ("srun", f"--nodes={n_nodes}", f"--ntasks={n_nodes}", "--ntasks-per-node=1", "--input=all",
                "--kill-on-bad-exit=1", "--overlap", f"--chdir={cwd}")
        agent = agent_argv(python, n_nodes, ranks_per_node, endpoint, run_id, ranks_per_node)
        return NodeLaunch("slurm", (NodeCommand(srun + agent, carried),), endpoint)
    endpoint = f"127.0.0.1:{port}"
    slices: list[str | None] = [None] * n_nodes
    if kind == "cuda":
        needed = n_nodes * ranks_per_node
        if visible_devices is None or len(visible_devices) < needed:
            seen = "an unknown number of" if visible_devices is None else str(len(visible_devices))
            where = (f"the Slurm allocation has {len(allocation)} node(s)" if allocation is not None
                     else "this is no Slurm allocation")
            raise AutofitError(f"{shape} cannot be probed here: one machine needs {needed} GPUs ({seen} visible), "
                               f"{where} and no --hosts were given; no probe (autofit estimate plans without one)")
        slices = list(device_slices(visible_devices, n_nodes, ranks_per_node))
    commands = tuple(
        NodeCommand(agent_argv(python, n_nodes, ranks_per_node, endpoint, run_id, n_nodes * ranks_per_node,
                               is_host=node == 0),
                    carried if slices[node] is None else carried | {"CUDA_VISIBLE_DEVICES": str(slices[node])})
        for node in range(n_nodes)
    )
    return NodeLaunch("local", commands, endpoint)


def _on_hosts(hosts: tuple[str, ...], n_nodes: int, ranks_per_node: int, environ: Mapping[str, str],
              carried: dict[str, str], python: str, cwd: str, port: int, run_id: str, this_host: str,
              which: Callable[[str], str | None], shape: str) -> NodeLaunch:
    check_host_count(hosts, n_nodes)
    for host in hosts:
        check_host(host)
    check_reachable(hosts, this_host)
    endpoint = f"{hosts[0]}:{port}"

    def is_here(host: str) -> bool:
        return host == this_host or is_loopback(host)

    if not all(is_here(host) for host in hosts) and which("ssh") is None:
        raise AutofitError(f"{shape}: --hosts needs ssh to start an agent on {hosts[0]} .. {hosts[-1]}, and ssh "
                           "is not on PATH; no probe across nodes (autofit estimate plans without one)")
    commands = []
    for node, host in enumerate(hosts):
        agent = agent_argv(python, n_nodes, ranks_per_node, endpoint, run_id, ranks_per_node, is_host=node == 0)
        if is_here(host):
            commands.append(NodeCommand(agent, carried))
        else:  # "--" ends ssh's options: the host is never read as one
            commands.append(NodeCommand(("ssh", "-o", "BatchMode=yes", "--", host, remote_command(agent, cwd, environ))))
    return NodeLaunch("hosts", tuple(commands), endpoint)


def remote_command(agent: tuple[str, ...], cwd: str, environ: Mapping[str, str]) -> str:
    """What ssh runs on a host: this directory, the forwarded variables (:data:`FORWARDED`,
    :data:`FORWARDED_PREFIXES`; not this machine's ``CUDA_VISIBLE_DEVICES``) through ``env`` (left out when
    none is), the agent; every word quoted for the remote shell."""
    forwarded = sorted(f"{k}={v}" for k, v in environ.items()
                       if (k in FORWARDED or k.startswith(FORWARDED_PREFIXES)) and k != "CUDA_VISIBLE_DEVICES")
    argv = ["env", *forwarded, *agent] if forwarded else list(agent)
    return f"cd {shlex.quote(cwd)} && {shlex.join(argv)}"
