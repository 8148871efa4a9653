"""Tiny random-weight models of any architecture of the installed transformers, built from the
architecture's own config class (no hub), each with a small local WordPiece tokenizer and saved to a
folder that `attnflow.load` opens like a user's model.

The shrink is generic: every integer field of the config whose name says what it is (layers, heads,
key/value heads, head width, hidden width, feed-forward width, experts, positions, vocabulary) is
set to a tiny size, per-layer lists are cut to two layers, composite configs are shrunk part by part.
`build_tiny` then perturbs every parameter initialised to a constant (norm weights, zero biases), so
a conformance check that confuses ``x·w`` with ``x·(1 + w)`` or drops a bias fails.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

Task = Literal["causal-lm", "sequence-classification"]

# transformers' name for each task's table of model types -> model class names.
_TASK_MAPPINGS: dict[str, str] = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
}
_AUTO_CLASSES: dict[str, str] = {
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
}

LAYERS = 2
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
ROPE_DIM = 8  # rotary width of a head where a config sets it apart (GPT-J's rotary_dim, MLA's rope part)
FFN = 96
EXPERT_FFN = 32
EXPERTS = 4
TOP_K = 2
VOCAB = 200  # above the tokenizer's < 160 entries; ids from 160 up are free for a config's special ids
POSITIONS = 128
WINDOW = 4  # a sliding window shorter than the 7-token test input, so local layers are local

WORDS = (
    "the a an movie was is terrible but acting great film plot good bad and of to in it this that "
    "very not cat sat on mat dog ran hi there hello world he she they i you we story ending"
).split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PUNCTUATION = list(".,!?;:'\"()-<>/")

# The tokenizer's special ids, written into every config field of that name.
_SPECIAL_IDS = {
    "pad_token_id": 0,
    "unk_token_id": 1,
    "bos_token_id": 2,
    "cls_token_id": 2,
    "decoder_start_token_id": 2,
    "eos_token_id": 3,
    "sep_token_id": 3,
    "mask_token_id": 4,
}


def tiny_vocab() -> dict[str, int]:
    """A WordPiece vocabulary (< 160 entries) that spells any lowercase ASCII text."""
    letters = list(string.ascii_lowercase + string.digits)
    words = SPECIALS + PUNCTUATION + letters + ["##" + c for c in letters] + WORDS
    return {word: index for index, word in enumerate(dict.fromkeys(words))}


def tiny_tokenizer(vocab: dict[str, int] | None = None) -> PreTrainedTokenizerFast:
    """A `BertTokenizerFast` over `tiny_vocab()` (or ``vocab``), at most 60 tokens."""
    from transformers import BertTokenizerFast

    return BertTokenizerFast(vocab=tiny_vocab() if vocab is None else vocab, model_max_length=60)


def architectures(task: Task) -> list[str]:
    """The model types that transformers' Auto class of ``task`` maps to a model class."""
    return list(_mapping(task))


def _mapping(task: str) -> dict[str, str]:
    from transformers.models.auto import modeling_auto

    if task not in _TASK_MAPPINGS:
        raise ValueError(f"task must be one of {sorted(_TASK_MAPPINGS)}, not {task!r}")
    return dict(getattr(modeling_auto, _TASK_MAPPINGS[task]))


# (field name pattern, size function of the default value), the first match wins. Sizes only shrink
# (``min``), so a field that is 0 or 1 by default (no shared experts, one dense layer) keeps its meaning.
def _at_most(size: int) -> Callable[[int], int]:
    return lambda value: min(value, size)


def _exactly(size: int) -> Callable[[int], int]:
    return lambda _value: size


_ROPE_FIELDS = r"rope_head_dim$|^rotary_dim$|^rotary_emb_base_dim$"
_KV_HEADS_FIELDS = r"(key_value|kv)_heads$|^n_head_kv$"
_SIZES: tuple[tuple[str, Callable[[int], int]], ...] = (
    (r"^vocab_size$", _exactly(VOCAB)),
    (r"vocab_size$", _at_most(VOCAB)),
    (r"first_k_dense", _at_most(1)),  # a dense first layer, then a mixture of experts
    (r"(^|_)(n|num)_?(hidden_)?layers?$|_layers$|^num_blocks$", _at_most(LAYERS)),
    (_KV_HEADS_FIELDS, _at_most(KV_HEADS)),
    (r"(^|_)(n|num)_?(attention_)?heads?$|attention_heads$|_heads$", _at_most(HEADS)),
    (_ROPE_FIELDS, _at_most(ROPE_DIM)),
    (r"head_dim$|^d_kv$|^d_head$|head_size$|lora_rank$", _at_most(HEAD_DIM)),
    (r"^(hidden_size|d_model|n_embd|dim|embed_dim|embedding_size|model_dim|word_embed_proj_dim)$", _at_most(HIDDEN)),
    (r"(moe|expert).*(intermediate_size|ffn_dim|hidden_dim)", _at_most(EXPERT_FFN)),
    (r"intermediate_size$|ffn_dim$|^d_ff$|^n_inner$|ffn_hidden_size$|^hidden_dim$|^mlp_dim$", _at_most(FFN)),
    (r"shared_experts$", _at_most(1)),
    (
        r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts|n_experts|num_routed_experts)$",
        _at_most(EXPERTS),
    ),
    (r"experts_per_tok$|^moe_topk$|^moe_k$|^num_selected_experts$|^top_k$", _at_most(TOP_K)),
    (r"^(n_group|topk_group)$", _at_most(1)),
    (r"max_position_embeddings$|^n_positions$|^n_ctx$|^max_seq_len$|^max_sequence_length$", _at_most(POSITIONS)),
    (r"^sliding_window$|^attention_window$|^attention_chunk_size$", _at_most(WINDOW)),
)


# Standard fields some configs leave None for the model to fill in, and some models read unfilled.
_UNSET = {"head_dim": HEAD_DIM, "num_key_value_heads": KV_HEADS}
# Fields a config derives from others, recomputed from the shrunk ones (MLA: a query/key head is
# its position-free part then its rotary part).
_DERIVED: dict[str, Callable[[dict[str, Any]], Any]] = {
    "qk_head_dim": lambda sizes: sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"],
}


def _tiny_size(name: str, value: int, defaults: dict[str, Any]) -> int:
    """``value``'s tiny size. A head width equal to the rotary width stays equal to it (MLA's ``head_dim``);
    key/value heads as many as the query heads stay as many (multi-head attention, MLA)."""
    rope_dims = {size for field, size in defaults.items() if re.search(_ROPE_FIELDS, field)}
    if re.search(r"head_dim$", name) and value in rope_dims:
        return ROPE_DIM
    if re.search(_KV_HEADS_FIELDS, name) and value == defaults.get("num_attention_heads"):
        return HEADS
    for pattern, size in _SIZES:
        if re.search(pattern, name):
            return size(value)
    return value


def _two_layers(values: list) -> list:
    """A per-layer list cut to two layers, keeping a second kind of layer where there is one:
    [sliding, sliding, …, full] -> [sliding, full]."""
    second = next((index for index, value in enumerate(values) if value != values[0]), 1)
    return [values[0], values[second]]


def _shrunk(config: Any) -> Any:
    """A config of ``config``'s class with tiny sizes; sub-configs (text, vision, audio …) shrunk too."""
    defaults = config.to_dict()
    n_layers = getattr(config, "num_hidden_layers", None)
    free_ids = iter(range(VOCAB - 1, len(tiny_vocab()), -1))  # for special ids the tokenizer lacks (images …)
    changes: dict[str, Any] = {
        name: size for name, size in _UNSET.items() if name in defaults and defaults[name] is None
    }
    for name, value in defaults.items():
        current = getattr(config, name, value)
        if hasattr(current, "to_dict") and hasattr(current, "model_type"):
            changes[name] = _shrunk(current)
        elif name in _SPECIAL_IDS and isinstance(value, (int, list)) and not isinstance(value, bool):
            changes[name] = _SPECIAL_IDS[name]
        elif re.search(r"_token_(id|index)$", name) and isinstance(value, int) and value >= VOCAB:
            changes[name] = next(free_ids)
        elif isinstance(value, int) and not isinstance(value, bool):
            changes[name] = _tiny_size(name, value, defaults)
        elif isinstance(value, list) and value and n_layers and len(value) == n_layers:
            changes[name] = _two_layers(value)
    sizes = {**defaults, **changes}
    changes |= {name: derive(sizes) for name, derive in _DERIVED.items() if name in defaults}
    return type(config)(**{**_overrides(config.model_type), **changes})


def _overrides(_model_type: str) -> dict[str, Any]:
    return {}


def tiny_config(model_type: str, task: Task = "causal-lm") -> PretrainedConfig:
    """The default config of ``model_type`` with tiny sizes (2 layers, hidden 64, 4 heads, 2 key/value
    heads, head width 16, feed-forward 96, vocabulary 200, 128 positions, 4 experts of which 2 are chosen)
    and the tokenizer's special ids; the text part of a composite config where the ``task`` class loads
    that. Sequence classifiers get 2 labels "neg"/"pos" and a pad id."""
    import transformers

    class_name = _mapping(task).get(model_type)
    if class_name is None:
        raise ValueError(f"transformers {transformers.__version__} has no {task} class for {model_type!r}")
    config = _shrunk(transformers.CONFIG_MAPPING[model_type]())
    loaded = getattr(transformers, class_name).config_class
    if not isinstance(config, loaded) and isinstance(config.get_text_config(), loaded):
        config = config.get_text_config()
    if task == "sequence-classification":
        config.num_labels = 2
        config.id2label, config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
        config.pad_token_id = _SPECIAL_IDS["pad_token_id"]
    return config


def randomise_constants(model: nn.Module, scale: float = 0.3) -> None:
    """Add ``scale``·N(0, 1) to every 1-D parameter and every parameter whose values are all equal
    (norm weights of ones or zeros, zero biases), in place, from torch's global generator."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            flat = parameter.flatten()
            if parameter.ndim == 1 or bool((flat == flat[0]).all()):
                parameter.add_(scale * torch.randn_like(parameter))


def build_tiny(model_type: str, folder: Path | str, task: Task = "causal-lm", seed: int = 0) -> Path:
    """Build a tiny random ``model_type`` for ``task`` (eager attention, float32, seeded, constants
    randomised) and save it with `tiny_tokenizer` to ``folder`` (safetensors); returns the folder."""
    import torch
    import transformers

    config = tiny_config(model_type, task)
    torch.manual_seed(seed)
    auto = getattr(transformers, _AUTO_CLASSES[task])
    model = auto.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomise_constants(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder
