"""Hugging Face models as entries: ``hf:ORG/NAME`` (a Hub name) or ``hf:PATH`` (a folder with ``config.json``).

The model is built from its config alone (random weights; no checkpoint is read), fp32, through transformers'
Auto classes (``AutoModelForCausalLM.from_config`` and its siblings), so planning builds it on the meta device
and a probe builds it under ``deepspeed.zero.Init`` like any other entry (:func:`autofit.ds.apply.build_context`).

The entry string carries its options, so every process that loads it by string -- the probe's ranks
(:mod:`autofit.probe.rank.worker`), the kernel footprint (:mod:`autofit.probe.footprint`), a scheduled worker --
builds the same workload::

    hf:examples/hf_configs/llama_gqa?seq_len=128
    hf:meta-llama/Llama-3.1-8B?seq_len=4096&task=causal-lm
    hf:./my_model?seq_len=512&task=classification&trust_remote_code=true

:class:`HfEntry` parses and writes that form; :class:`HfOptions` is the typed record of the options
(``seq_len``, ``target_len``, ``task``, ``attention``, ``trust_remote_code``).

The config is read offline first (``local_files_only=True``: a local folder or the local Hugging Face cache),
then from the Hub only where the Hub is reachable and ``HF_HUB_OFFLINE`` is not set. Code from the model's
repository (a config's ``auto_map``) runs only when ``trust_remote_code`` is passed; transformers' interactive
prompt is never reached (``trust_remote_code`` is always a bool here, ``dynamic_module_utils.
resolve_trust_remote_code``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote

from autofit.core.errors import AutofitError
from autofit.core.sequence import SequenceShape
from autofit.workload.hf_positions import TextLengths, text_lengths
from autofit.workload.hf_tasks import (
    ATTN_IMPLEMENTATION,
    SEQ_LEN_TASKS,
    TASKS,
    TOKEN_TASKS,
    batch_maker,
    check_task,
    flash_stand_in,
    kernels_of,
    layers_of,
    model_builder,
    model_class_for,
    sequence_lengths,
    task_from_config,
)
from autofit.workload.types import Workload

PREFIX = "hf:"
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


@dataclass(frozen=True)
class HfOptions:
    """How an ``hf:`` model is trained: what the model's config does not say."""

    seq_len: int | None = None
    """Tokens per sample (the encoder's for seq2seq); required for causal-lm, seq2seq, masked-lm and classification,
    the config's limit by default for contrastive and speech-seq2seq (:mod:`autofit.workload.hf_positions`), unused
    for vision, where the config's ``image_size`` and ``patch_size`` set the sequence."""
    target_len: int | None = None
    """seq2seq only: the decoder's tokens per sample (the labels' length); None: ``seq_len``."""
    task: str | None = None
    """One of :data:`TASKS`; None: from the config's ``architectures``."""
    attention: str | None = None
    """The kernel (``eager``, ``sdpa``, ``flash``) the model is built with when none is asked for; the search
    still chooses among the space's kernels (fix one with ``--set attention=...``). None: transformers' default."""
    trust_remote_code: bool = False
    """Run the model repository's own code (a config's ``auto_map``): only when the user says so."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "target_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise AutofitError(f"hf option {name} must be a positive int, but got {name}={value!r}")
        if self.task is not None and self.task not in TASKS:
            raise AutofitError(f"hf option task must be one of {', '.join(TASKS)}, but got task={self.task!r}")
        if self.attention is not None and self.attention not in ATTN_IMPLEMENTATION:
            raise AutofitError(f"hf option attention must be one of {', '.join(ATTN_IMPLEMENTATION)}, "
                               f"but got attention={self.attention!r}")
        if not isinstance(self.trust_remote_code, bool):
            raise AutofitError(f"hf option trust_remote_code must be a bool, but got {self.trust_remote_code!r}")
        if self.target_len is not None and self.task not in (None, "seq2seq"):
            raise AutofitError(f"hf option target_len is for seq2seq only, but got task={self.task!r}")


@dataclass(frozen=True)
class HfEntry:
    """An ``hf:`` entry string, parsed: ``hf:SOURCE[?key=value&...]`` with :class:`HfOptions`' fields as keys."""

    source: str
    """A Hub model name (``ORG/NAME``) or a local folder holding ``config.json``."""
    options: HfOptions = field(default_factory=HfOptions)
    """The training options the entry string carries."""

    def __post_init__(self) -> None:
        if not self.source or "?" in self.source:
            raise AutofitError(f"hf entry needs a Hub name or a folder without '?', but got source={self.source!r}")

    @classmethod
    def parse(cls, entry: str) -> HfEntry:
        """``hf:SOURCE?seq_len=128&task=causal-lm`` -> an :class:`HfEntry`; a bad key or value is one error line."""
        if not is_hf_entry(entry):
            raise AutofitError(f"an hf entry starts with {PREFIX!r}, but got {entry!r}")
        source, _, query = entry[len(PREFIX):].partition("?")
        known = {f.name: f for f in fields(HfOptions)}
        values: dict[str, Any] = {}
        for key, text in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
            if key not in known:
                raise AutofitError(f"hf entry {entry!r}: unknown option {key!r} (known: {', '.join(known)})")
            values[key] = _option_value(entry, key, text)
        return cls(source=source, options=HfOptions(**values))

    def to_entry(self) -> str:
        """The canonical entry string: the options that differ from their defaults, in field order."""
        defaults = HfOptions()
        pairs = [(f.name, getattr(self.options, f.name)) for f in fields(HfOptions)
                 if getattr(self.options, f.name) != getattr(defaults, f.name)]
        query = "&".join(f"{key}={quote(str(value).lower() if isinstance(value, bool) else str(value))}"
                         for key, value in pairs)
        return f"{PREFIX}{self.source}" + (f"?{query}" if query else "")

    def with_options(self, **changes: Any) -> HfEntry:
        """The same model with some options changed (a None leaves that option as the entry has it)."""
        return replace(self, options=replace(self.options, **{k: v for k, v in changes.items() if v is not None}))

    def absolute(self) -> HfEntry:
        """A local folder made absolute (a process started elsewhere loads the same one); a Hub name as is."""
        path = Path(self.source).expanduser()
        return replace(self, source=str(path.resolve())) if path.is_dir() else self


def is_hf_entry(entry: str) -> bool:
    """Whether ``entry`` names a Hugging Face model (``hf:...``) rather than ``path.py:function``."""
    return entry.startswith(PREFIX)


def with_hf_options(entry: str, *, seq_len: int | None = None, task: str | None = None,
                    trust_remote_code: bool = False) -> str:
    """``entry`` with the CLI's ``--seq-len``/``--task``/``--trust-remote-code`` folded into it (the canonical
    string probes re-load); an entry that is not ``hf:`` takes none of them."""
    if not is_hf_entry(entry):
        given = [name for name, value in (("--seq-len", seq_len), ("--task", task)) if value is not None]
        given += ["--trust-remote-code"] if trust_remote_code else []
        if given:
            raise AutofitError(f"only an hf: entry takes {', '.join(given)}, but the entry is {entry!r}")
        return entry
    parsed = HfEntry.parse(entry)
    return parsed.with_options(seq_len=seq_len, task=task, trust_remote_code=trust_remote_code or None).to_entry()


def load_hf_entry(entry: str) -> Workload:
    """The workload an ``hf:`` entry string names (:func:`autofit.workload.entry.load_workload` dispatches here)."""
    parsed = HfEntry.parse(entry)
    o = parsed.options
    try:
        return hf_workload(parsed.source, seq_len=o.seq_len, target_len=o.target_len, task=o.task,
                           attention=o.attention, trust_remote_code=o.trust_remote_code)
    except AutofitError:
        raise
    except Exception as exc:  # transformers' own, on a config it reads but cannot use
        raise AutofitError(f"entry {entry!r} raised {type(exc).__name__}: {_first_line(exc)}") from exc


def entry_lengths(entry: str) -> TextLengths | None:
    """The lengths an ``hf:`` entry's text is planned at, with what the plan says of them (the config's default, a
    length past its limit: :func:`autofit.workload.hf_positions.text_lengths`), read from its config alone (nothing
    is built, so a plan the trace cache answers says the same); None for another entry or a vision task."""
    if not is_hf_entry(entry):
        return None
    parsed = HfEntry.parse(entry)
    o = parsed.options
    config = load_config(parsed.source, trust_remote_code=o.trust_remote_code)
    task = o.task or task_from_config(config, parsed.source)
    return text_lengths(config, task, o.seq_len, o.target_len, parsed.source) if task in SEQ_LEN_TASKS else None


def hf_workload(name_or_path: str, *, seq_len: int | None, target_len: int | None = None, task: str | None = None,
                attention: str | None = None, trust_remote_code: bool = False) -> Workload:
    """A :class:`Workload` of the Hugging Face model ``name_or_path`` (a Hub name or a folder with ``config.json``):
    random fp32 weights from its config, a random batch for ``task``, its repeated blocks.

    ``seq_len``: tokens per sample (text tasks; the encoder's for seq2seq, whose decoder takes ``target_len``,
    default ``seq_len``). ``task``: one of :data:`TASKS`, default from the config's ``architectures``.
    ``attention``: the kernel built when none is asked (see :class:`HfOptions`). Errors are one line each.
    """
    options = HfOptions(seq_len=seq_len, target_len=target_len, task=task, attention=attention,
                        trust_remote_code=trust_remote_code)
    config = load_config(name_or_path, trust_remote_code=trust_remote_code)
    task = options.task or task_from_config(config, name_or_path)
    check_task(config, task, name_or_path)
    lengths = sequence_lengths(config, task, options.seq_len, options.target_len, name_or_path)
    # the kernels the class can be built with, read from transformers' flags before anything is built or traced
    model_class = model_class_for(config, task, name_or_path, trust_remote_code)
    kernels, note = kernels_of(model_class, config)
    return Workload(
        model=model_builder(config, task, options.attention, trust_remote_code),
        batch=batch_maker(config, task, lengths),
        layers=layers_of(task),
        tokens_per_sample=sum(lengths) if lengths and task in TOKEN_TASKS else None,
        name=display_name(name_or_path),
        sequence=sequence_shape(config, lengths[0], model_class) if task == "causal-lm" else None,
        attention_kernels=kernels,
        kernel_note=note,
        flash_stand_in=flash_stand_in(kernels),
        at_length=_at_length(name_or_path, options, task) if kernels == () and task == "causal-lm" else None,
    )


def _at_length(name_or_path: str, options: HfOptions, task: str) -> Callable[[int], Workload]:
    """:attr:`Workload.at_length` of a causal LM without attention (a state-space model, whose reference scan,
    without its fused kernels, loops over the tokens)."""

    def at(seq_len: int) -> Workload:
        return hf_workload(name_or_path, seq_len=seq_len, task=task, attention=options.attention,
                           trust_remote_code=options.trust_remote_code)

    return at


def sequence_shape(config: Any, seq_len: int, model_class: Any = None) -> SequenceShape | None:
    """A causal LM's sequence, attention heads and hidden size, from its text config (``num_attention_heads``,
    ``num_key_value_heads``: what DeepSpeed's ``register_with_transformers`` reads), and what AutoTP shards it by:
    its widths and the styles of its ``tp_plan`` (:func:`tp_plan_styles`); None for a model without attention heads
    (a state-space model: nothing for sequence parallelism to split)."""
    text = config.get_text_config()
    if not getattr(text, "num_attention_heads", None):
        return None
    heads = int(text.num_attention_heads)
    return SequenceShape(seq_len=seq_len, n_heads=heads, n_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                         hidden_size=int(getattr(text, "hidden_size", 0) or 0),
                         intermediate_size=int(getattr(text, "intermediate_size", 0) or 0),
                         vocab_size=int(getattr(text, "vocab_size", 0) or 0),
                         tp_styles=tp_plan_styles(config, model_class),
                         tied_head=bool(getattr(config, "tie_word_embeddings", False)))


def tp_plan_styles(config: Any, model_class: Any) -> tuple[str, ...]:
    """The partition styles of the plan DeepSpeed's AutoTP shards the model by: the text config's
    ``base_model_tp_plan`` merged with the model class's ``_tp_plan`` (the head's), as ``_get_hf_tp_plan`` merges
    them (``deepspeed/runtime/tensor_parallel/config.py``); sorted, empty where the model states no plan."""
    plans = (getattr(config.get_text_config(), "base_model_tp_plan", None), getattr(model_class, "_tp_plan", None))
    return tuple(sorted({str(style).lower() for plan in plans if isinstance(plan, dict) for style in plan.values()}))


def load_config(name_or_path: str, *, trust_remote_code: bool = False) -> Any:
    """The model's ``PreTrainedConfig``: from a local folder or the local cache first, then from the Hub where it
    is reachable. Not found anywhere, remote code not trusted, a malformed config: one AutofitError line."""
    from transformers import AutoConfig

    def read(local_files_only: bool) -> Any:
        try:
            return AutoConfig.from_pretrained(name_or_path, local_files_only=local_files_only,
                                              trust_remote_code=trust_remote_code)
        except ValueError as exc:  # transformers' refusal of remote code, or a config it cannot parse
            if "trust_remote_code" in str(exc):
                raise AutofitError(f"hf:{name_or_path} needs its repository's own code to build its config; pass "
                                   "--trust-remote-code (trust_remote_code=true) if you trust it") from exc
            raise AutofitError(f"hf:{name_or_path}: its config does not load: {_first_line(exc)}") from exc

    folder = Path(name_or_path).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():  # transformers 5 reads it as a config of no type
        raise AutofitError(not_found_message(name_or_path, hub_offline()))
    # config.json is there (above): an OSError is then about the code its auto_map names (a module the folder lacks,
    # or one of another repository, org/repo--module.Class, not in the local cache)
    remote_folder = folder.is_dir() and trust_remote_code
    try:
        return read(local_files_only=True)
    except OSError as exc:  # transformers' cached_file: neither a folder with config.json nor in the cache
        if remote_folder and hub_offline():
            raise AutofitError(remote_code_missing(name_or_path, exc)) from exc
        if not remote_folder and (_looks_local(name_or_path) or hub_offline()):
            raise AutofitError(not_found_message(name_or_path, hub_offline())) from exc
    try:
        return read(local_files_only=False)
    except AutofitError:
        raise
    except Exception as exc:  # OSError from transformers, or the HTTP client's own connection errors
        if remote_folder:
            raise AutofitError(remote_code_missing(name_or_path, exc)) from exc
        raise AutofitError(f"{not_found_message(name_or_path, False)} ({_first_line(exc)})") from exc


def not_found_message(name_or_path: str, offline: bool) -> str:
    """The one line for a config that is neither local nor cached nor fetched."""
    if _looks_local(name_or_path):
        return f"hf:{name_or_path}: no config.json in that folder (a local model folder needs its config.json)"
    why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub is not reachable (or has no such model)"
    return (f"hf:{name_or_path}: no config.json in the local Hugging Face cache and {why}; fetch it once where the "
            f"Hub is reachable (`hf download {name_or_path} config.json`), or give hf:PATH to a folder with config.json")


def remote_code_missing(name_or_path: str, exc: BaseException) -> str:
    """The one line for a folder whose config.json names code (``auto_map``) that is not beside it: a module file
    the folder lacks, or one in another repository (``org/repo--module.Class``) not in the local cache."""
    try:
        auto_map = json.loads((Path(name_or_path).expanduser() / "config.json").read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        auto_map = {}
    code = auto_map.get("AutoConfig", "its auto_map's code") if isinstance(auto_map, dict) else "its auto_map's code"
    return (f"hf:{name_or_path}: config.json is there, but the code it names ({code}) is not: put its .py files "
            f"beside config.json, or fetch that repository once where the Hub is reachable ({_first_line(exc)})")


def hub_offline() -> bool:
    """Whether the Hub must not be asked: ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` as huggingface_hub reads them
    (``huggingface_hub/constants.py``), or set in this process since it imported."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or any(
        os.environ.get(var, "").upper() in ("1", "ON", "YES", "TRUE") for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def display_name(name_or_path: str) -> str:
    """A Hub name as is, a local folder by its own name."""
    path = Path(name_or_path).expanduser()
    return path.resolve().name if path.is_dir() else name_or_path


def _option_value(entry: str, key: str, text: str) -> Any:
    """An option's value from its text in the entry string."""
    if key in ("seq_len", "target_len"):
        if not text.isdigit():
            raise AutofitError(f"hf entry {entry!r}: {key} must be a positive int, but got {text!r}")
        return int(text)
    if key == "trust_remote_code":
        if text.lower() not in _TRUE + _FALSE:
            raise AutofitError(f"hf entry {entry!r}: trust_remote_code must be true or false, but got {text!r}")
        return text.lower() in _TRUE
    return text


def _looks_local(name_or_path: str) -> bool:
    """A folder rather than a Hub name: it exists, or it is written as a path (``./x``, ``/x``, ``~/x``, ``a/b/c``)."""
    return Path(name_or_path).expanduser().is_dir() or name_or_path.startswith((".", "/", "~")) \
        or name_or_path.count("/") > 1


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
