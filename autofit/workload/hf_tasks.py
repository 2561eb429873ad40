"""What an ``hf:`` model trains on and with: its task (:data:`TASKS`), the class transformers builds for it, the
attention kernels that class can be built with, its batch and its repeated blocks (:mod:`autofit.workload.hf` is
the entry string and the config).

Kernels come from the model class, before anything is traced: transformers' own ``_supports_sdpa`` and
``_supports_flash_attn`` flags, which ``PreTrainedModel.get_correct_attn_implementation`` checks at ``__init__``
(:func:`supported_kernels`). A model that refuses sdpa (Gemma-2: softcapping) is planned with the kernels it takes;
one with no attention at all (Mamba) has no kernel to choose.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

from autofit.core.errors import AutofitError
from autofit.workload.hf_positions import text_lengths
from autofit.workload.types import ATTENTION_KERNELS, find_attention_modules, longest_module_list

#: the training tasks an ``hf:`` entry builds: task -> (transformers Auto class, its ``*_MAPPING_NAMES`` in
#: ``transformers/models/auto/modeling_auto.py``, the architecture-name suffix of a model outside that mapping, ""
#: where a suffix says nothing)
TASKS: dict[str, tuple[str, str, str]] = {
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "ForCausalLM"),
    "seq2seq": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "ForSeq2SeqLM"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "ForMaskedLM"),
    "classification": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                       "ForSequenceClassification"),
    "vision-classification": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
                              "ForImageClassification"),
    # a dual encoder (CLIP, SigLIP, ALIGN): text and images, the model's own contrastive loss (return_loss=True)
    "contrastive": ("AutoModel", "MODEL_MAPPING_NAMES", ""),
    # speech in, tokens out (Whisper): the encoder's input features from the config, --seq-len the decoder's
    "speech-seq2seq": ("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", ""),
}
#: autofit's attention kernels -> transformers' ``attn_implementation`` (``modeling_utils.py``)
ATTN_IMPLEMENTATION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}
#: the ``attention`` value that builds a model with transformers' own SDPA function registered under this name
#: (:func:`attn_implementation`), past a class flag that refuses ``sdpa``: what the trace stands in for flash-attn
#: with (:attr:`autofit.workload.types.Workload.flash_stand_in`) where a class takes flash but not SDPA. Gemma-2's
#: flag guards its logit soft-capping, which flash-attn computes inside its kernel: what attention holds is the same
SDPA_STAND_IN = "autofit_stand_in"  # transformers reads "sdpa", "flash" and "flex" in a name as those kernels
#: tasks whose samples are token sequences of ``--seq-len`` (tokens/s); the others count samples
TOKEN_TASKS = ("causal-lm", "seq2seq", "masked-lm", "classification")
#: tasks that take ``--seq-len`` (a contrastive model's text, a speech model's decoder)
SEQ_LEN_TASKS = (*TOKEN_TASKS, "contrastive", "speech-seq2seq")
#: speech-seq2seq families whose encoder input autofit can make: model_type -> (n, *shape) from the config.
#: Whisper requires its full window: ``2 * max_source_positions`` mel frames ("Whisper expects the mel input features
#: to be of length 3000", ``modeling_whisper.py``)
SPEECH_INPUTS: dict[str, Callable[[Any], tuple[int, ...]]] = {
    "whisper": lambda c: (int(c.num_mel_bins), 2 * int(c.max_source_positions)),
}


def task_from_config(config: Any, name_or_path: str) -> str:
    """The task of the config's first ``architectures`` class: a dual encoder's is contrastive, else the Auto mapping
    that lists it, else its name's suffix (``LlamaForCausalLM`` -> causal-lm); one AutofitError line where it names
    no task."""
    from transformers.models.auto import modeling_auto

    architectures = list(getattr(config, "architectures", None) or [])
    if is_dual_encoder(config):
        return "contrastive"
    for architecture in architectures[:1]:
        # transformers' own mappings first: T5ForConditionalGeneration is seq2seq, LlavaForConditionalGeneration not
        for task, (_, mapping, _) in TASKS.items():
            if task != "contrastive" and architecture in _class_names(getattr(modeling_auto, mapping)):
                return task
        for task, (_, _, suffix) in TASKS.items():  # a class of the repository's own code
            if suffix and architecture.endswith(suffix):
                return task
    named = f"names {architectures[0]}" if architectures else "names no architectures"
    raise AutofitError(f"hf:{name_or_path}: cannot tell the task (its config {named}); pass --task "
                       f"(one of {', '.join(TASKS)})")


def is_dual_encoder(config: Any) -> bool:
    """A config of two towers, text and vision (CLIP, SigLIP, ALIGN): the contrastive task's."""
    return getattr(config, "text_config", None) is not None and getattr(config, "vision_config", None) is not None


def check_task(config: Any, task: str, name_or_path: str) -> None:
    """One line where ``task`` would train something other than the model the config describes, or cannot be
    given an input: a dual encoder asked for one tower's task, a speech family whose input autofit cannot make."""
    if is_dual_encoder(config) and task != "contrastive":
        named = (list(getattr(config, "architectures", None) or []) or [type(config).__name__])[0]
        raise AutofitError(f"hf:{name_or_path}: {named} is a contrastive dual encoder (text + vision); --task {task} "
                           "would train one tower of it alone: pass --task contrastive")
    if task == "contrastive" and not is_dual_encoder(config):
        raise AutofitError(f"hf:{name_or_path}: --task contrastive needs a dual encoder (a config with text_config and "
                           f"vision_config), but {type(config).__name__} has no such pair")
    if task == "speech-seq2seq" and config.model_type not in SPEECH_INPUTS:
        raise AutofitError(f"hf:{name_or_path}: autofit cannot make the speech input of {config.model_type} models "
                           f"(it knows {', '.join(SPEECH_INPUTS)}); write an entry point with its batch")


def model_class_for(config: Any, task: str, name_or_path: str, trust_remote_code: bool) -> Any:
    """The class ``TASKS[task]``'s Auto class builds for ``config`` (``auto_factory._get_model_class``, or the
    repository's own from the config's ``auto_map`` with ``trust_remote_code``), without building it; one
    AutofitError line where the Auto class has none (transformers' own error lists every class it knows)."""
    import transformers
    from transformers.models.auto.auto_factory import _get_model_class

    auto_name = TASKS[task][0]
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and auto_name in auto_map:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(auto_map[auto_name], name_or_path)
    mapping = getattr(transformers, auto_name)._model_mapping
    if type(config) not in mapping:
        architectures = list(getattr(config, "architectures", None) or [])
        named = architectures[0] if architectures else type(config).__name__
        fits = [t for t, (auto, _, _) in TASKS.items() if type(config) in getattr(transformers, auto)._model_mapping
                and (t != "contrastive" or is_dual_encoder(config))]
        hint = f"pass --task {' or '.join(fits)}" if fits else f"autofit's tasks are {', '.join(TASKS)}"
        raise AutofitError(f"hf:{name_or_path}: {type(config).__name__} has no {auto_name} class, so --task {task} "
                           f"cannot build it (its config names {named}); {hint}")
    return _get_model_class(config, mapping)


def supported_kernels(model_class: Any) -> tuple[str, ...]:
    """The autofit kernels ``model_class`` can be built with, as transformers decides at ``__init__``
    (``PreTrainedModel.get_correct_attn_implementation``: ``_sdpa_can_dispatch`` refuses a class whose
    ``_supports_sdpa`` is False, ``_flash_attn_can_dispatch`` one whose ``_supports_flash_attn`` is False;
    ``_supports_flash_attn_2`` is the flag of older remote code). Eager always builds."""
    kernels = ["eager"]
    if getattr(model_class, "_supports_sdpa", False):
        kernels.append("sdpa")
    if getattr(model_class, "_supports_flash_attn", False) or getattr(model_class, "_supports_flash_attn_2", False):
        kernels.append("flash")
    return tuple(kernels)


def kernels_of(model_class: Any, config: Any) -> tuple[tuple[str, ...] | None, str | None]:
    """``(Workload.attention_kernels, Workload.kernel_note)`` of ``model_class``: None where it takes every kernel;
    () where it has no attention (no kernel flag and no ``num_attention_heads``: Mamba, RWKV); else those it takes,
    with the sentence that says why."""
    name = getattr(model_class, "__name__", str(model_class))
    kernels = supported_kernels(model_class)
    if kernels == ("eager",) and getattr(config.get_text_config(), "num_attention_heads", None) is None:
        return (), f"{name} has no attention: no kernel is chosen"
    if kernels == ATTENTION_KERNELS:
        return None, None
    refused = [k for k in ATTENTION_KERNELS if k not in kernels]
    flags = ", ".join(f"_supports_{'flash_attn' if k == 'flash' else k} = False" for k in refused)
    return kernels, (f"{name} cannot be built with {', '.join(refused)} (transformers' {flags}): "
                     f"planned with {', '.join(kernels)}")


def sequence_lengths(config: Any, task: str, seq_len: int | None, target_len: int | None,
                     name_or_path: str) -> tuple[int, ...]:
    """Tokens per sample of each stack: ``(seq_len,)``, ``(seq_len, target_len)`` for seq2seq; () for vision, an
    image workload (throughput in images/s, ``Workload.tokens_per_sample`` None). A contrastive model's ``seq_len``
    is its text's, a speech model's its decoder's (the encoder's input is set by the config); their default is the
    config's limit, and a length past the limit is planned or refused by how the model keeps positions
    (:func:`autofit.workload.hf_positions.text_lengths`)."""
    if task not in SEQ_LEN_TASKS:
        if seq_len is not None:
            raise AutofitError(f"hf:{name_or_path} ({task}) takes its input size from the config's image_size, "
                               f"but got seq_len={seq_len}")
        return ()
    return text_lengths(config, task, seq_len, target_len, name_or_path).lengths


def attention_blocks(model: Any) -> list[Any]:
    """The longest ``nn.ModuleList`` whose blocks hold attention: a decoder's layers, not a per-layer list of
    experts (an MoE in transformers < 5, or in remote code, keeps more experts than layers); else the longest."""
    from torch import nn

    best: list[Any] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best) \
                and all(find_attention_modules(block) for block in module):
            best = list(module)
    return best or longest_module_list(model)


def encoder_decoder_blocks(model: Any) -> list[Any]:
    """The encoder's blocks, then the decoder's, in execution order: an encoder-decoder keeps two lists of equal
    length (T5's ``encoder.block`` and ``decoder.block``), and the longest alone would be the encoder's half."""
    return [*attention_blocks(model.get_encoder()), *attention_blocks(model.get_decoder())]


def tower_blocks(model: Any) -> list[Any]:
    """A dual encoder's text blocks, then its vision blocks (``text_model`` and ``vision_model``, as CLIP and SigLIP
    name them; else each tower's longest list)."""
    towers = [getattr(model, name, None) for name in ("text_model", "vision_model")]
    return [block for tower in towers if tower is not None for block in attention_blocks(tower)]


def layers_of(task: str) -> Callable[[Any], list[Any]]:
    """The repeated blocks of ``task``'s model."""
    if task in ("seq2seq", "speech-seq2seq"):
        return encoder_decoder_blocks
    return tower_blocks if task == "contrastive" else attention_blocks


def model_builder(config: Any, task: str, attention: str | None, trust_remote_code: bool) -> Callable[..., Any]:
    """``(attention=None) -> nn.Module``: a fresh fp32 model of ``config`` for ``task``, random weights."""
    import transformers

    auto_class = getattr(transformers, TASKS[task][0])

    def build(attention: str | None = attention) -> Any:
        import torch

        kwargs: dict[str, Any] = {"dtype": torch.float32, "trust_remote_code": trust_remote_code}
        if attention is not None:
            kwargs["attn_implementation"] = attn_implementation(attention)
        # a copy: from_config writes the dtype and the kernel into the config it is given
        return auto_class.from_config(copy.deepcopy(config), **kwargs)

    return build


def attn_implementation(attention: str) -> str:
    """transformers' ``attn_implementation`` for autofit's kernel ``attention`` (:data:`ATTN_IMPLEMENTATION`), or
    :data:`SDPA_STAND_IN`, registered with transformers' ``AttentionInterface`` (and no mask function: transformers
    then makes no mask, and SDPA runs causal, as flash-attn does) on first use."""
    if attention == SDPA_STAND_IN:
        from transformers import AttentionInterface

        AttentionInterface.register(SDPA_STAND_IN, _sdpa_as_flash_attn)
        return SDPA_STAND_IN
    if attention not in ATTN_IMPLEMENTATION:
        raise AutofitError(f"attention must be one of {', '.join(ATTN_IMPLEMENTATION)}, but got {attention=}")
    return ATTN_IMPLEMENTATION[attention]


def _sdpa_as_flash_attn(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """transformers' SDPA attention function without the logit soft-capping it refuses (``softcap``), which flash-attn
    applies inside its kernel to scores it never holds: the same tensors saved either way."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("softcap", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def flash_stand_in(kernels: tuple[str, ...] | None) -> str:
    """:attr:`autofit.workload.types.Workload.flash_stand_in` of a class that takes ``kernels`` (None: all)."""
    return SDPA_STAND_IN if kernels and "flash" in kernels and "sdpa" not in kernels else "sdpa"


def batch_maker(config: Any, task: str, lengths: tuple[int, ...]) -> Callable[[int], dict[str, Any]]:
    """``(n) -> batch``: random CPU tensors of ``n`` samples, the inputs and labels ``task``'s model takes."""
    text = config.get_text_config()
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    n_labels = int(getattr(config, "num_labels", 2))

    def batch(n: int) -> dict[str, Any]:
        import torch

        if task in ("vision-classification", "contrastive"):
            vision = getattr(config, "vision_config", None) or config
            size = _pair(getattr(vision, "image_size", 224))
            pixels = torch.randn(n, int(getattr(vision, "num_channels", 3)), size[0], size[1])
            if task == "contrastive":  # the model's own CLIP-style loss over the n x n similarities
                return {"input_ids": torch.randint(0, vocab, (n, lengths[0])), "pixel_values": pixels,
                        "return_loss": True}
            return {"pixel_values": pixels, "labels": torch.randint(0, n_labels, (n,))}
        if task == "speech-seq2seq":  # the decoder's labels; the model shifts them into decoder_input_ids
            features = torch.randn(n, *SPEECH_INPUTS[config.model_type](config))
            return {"input_features": features, "labels": torch.randint(0, vocab, (n, lengths[0]))}
        input_ids = torch.randint(0, vocab, (n, lengths[0]))
        if task in ("causal-lm", "masked-lm"):  # the causal model shifts the labels itself
            return {"input_ids": input_ids, "labels": input_ids.clone()}
        mask = torch.ones(n, lengths[0], dtype=torch.long)
        if task == "seq2seq":  # the model makes decoder_input_ids from the labels (shift_right)
            return {"input_ids": input_ids, "attention_mask": mask, "labels": torch.randint(0, vocab, (n, lengths[1]))}
        return {"input_ids": input_ids, "attention_mask": mask, "labels": torch.randint(0, n_labels, (n,))}

    return batch


def takes_return_loss(model_class: Any) -> bool:
    """Whether the class's ``forward`` computes its own contrastive loss (``return_loss``)."""
    try:
        return "return_loss" in inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):
        return False


def _class_names(mapping: Any) -> set[str]:
    """The class names an Auto mapping lists (a value may be one name or a tuple of them)."""
    names: set[str] = set()
    for value in mapping.values():
        names.update((value,) if isinstance(value, str) else value)
    return names


def _pair(value: Any) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (tuple, list)) else (int(value), int(value))
