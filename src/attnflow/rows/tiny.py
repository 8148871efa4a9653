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
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

Task = Literal["causal-lm", "sequence-classification"]

# transformers' name for each task's table of model types -> model class names.
_TASK_MAPPINGS: dict[str, str] = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
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


def _at_most(size: int) -> Callable[[int], int]:
    return lambda value: min(value, size)


def _exactly(size: int) -> Callable[[int], int]:
    return lambda _value: size


_ROPE_FIELDS = r"rope_head_dim$|^rotary_dim$|^rotary_emb_base_dim$"
_KV_HEADS_FIELDS = r"(key_value|kv)_heads$|^n_head_kv$"
_HIDDEN_FIELDS = (
    r"hidden_size|bottleneck_size$"
    r"|^(d_model|n_embd|dim|embed_dim|embedding_dim|embedding_size|model_dim|word_embed_proj_dim)$"
)
# (field name pattern, size function of the default value), the first match wins. Sizes only shrink
# (``min``), so a field that is 0 or 1 by default (no shared experts, one dense layer) keeps its meaning.
_SIZES: tuple[tuple[str, Callable[[int], int]], ...] = (
    (r"^vocab_size$", _exactly(VOCAB)),
    (r"vocab_size$|_vocab$", _at_most(VOCAB)),  # other vocabularies: per-layer inputs, hashed byte groups
    (r"first_k_dense", _at_most(1)),  # a dense first layer, then a mixture of experts
    (r"^(n|num)_?(hidden_|encoder_|decoder_)?layers?$|^(encoder|decoder)_layers$|^num_blocks$", _at_most(LAYERS)),
    (r"kv_shared_layers$", _exactly(0)),  # two layers leave none to reuse another's cache
    (r"_layers$", _at_most(LAYERS - 1)),  # a subset of the layers (kv-shared, dense, predicting): one of two
    (r"layer_offset$", _at_most(1)),  # a hybrid's attention / expert layers: every other layer from layer 1
    (r"layer_period$", _at_most(LAYERS)),
    (_KV_HEADS_FIELDS, _at_most(KV_HEADS)),
    (r"(^|_)(n|num)_?(attention_)?heads?$|attention_heads$|_heads$", _at_most(HEADS)),
    (_ROPE_FIELDS, _at_most(ROPE_DIM)),
    (r"head_?dim$|^d_kv$|^d_head$|head_size$|lora_rank$", _at_most(HEAD_DIM)),
    (r"(moe|expert).*(intermediate_size|ffn_dim|hidden_dim)", _at_most(EXPERT_FFN)),
    (_HIDDEN_FIELDS, _at_most(HIDDEN)),
    (r"intermediate_size$|ffn_dim$|^d_ff$|^n_inner$|ffn_hidden_size$|^hidden_dim$|^mlp_dim$", _at_most(FFN)),
    (r"shared_experts$", _at_most(1)),
    (
        r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts|n_experts|num_routed_experts)$",
        _at_most(EXPERTS),
    ),
    (r"experts_per_tok(en)?$|^moe_topk$|^moe_k$|^num_selected_experts$|^top_k$", _at_most(TOP_K)),
    (r"^(n_group|topk_group|num_expert_group)$", _at_most(1)),  # one group holds every expert
    (r"^n_groups$|ngroups$", _at_most(1)),  # a Mamba-2 mixer's groups of heads sharing B and C
    (r"max_position_embeddings$|^n_positions$|^n_ctx$|^max_seq_len$|^max_sequence_length$", _at_most(POSITIONS)),
    (r"^sliding_window$|^attention_window$|^attention_chunk_size$", _at_most(WINDOW)),
    # prompt embeddings stacked under the vocabulary (types × length rows): kept few, so the
    # embedding matrix stays about the tokenizer's size
    (r"^prompt_types$", _at_most(3)),  # the prompt ids are those of the third type
    (r"^prompt_length$", _at_most(2)),
)


# Standard fields some configs leave None for the model to fill in, and some models read unfilled.
_UNSET = {
    "head_dim": HEAD_DIM,
    "num_key_value_heads": KV_HEADS,
    "vocab_size": VOCAB,
    "n_routed_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "n_shared_experts": 1,
}
# Fields a config derives from others, recomputed from the shrunk ones (MLA: a query/key head is
# its position-free part then its rotary part).
_DERIVED: dict[str, Callable[[dict[str, Any]], Any]] = {
    "qk_head_dim": lambda sizes: sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"],
    # a Mamba-2 mixer's heads span its expanded width
    "mamba_d_ssm": lambda sizes: sizes["mamba_d_ssm"] and sizes["mamba_expand"] * sizes["hidden_size"],
    "mamba_d_head": lambda sizes: sizes["mamba_expand"] * sizes["hidden_size"] // sizes["mamba_n_heads"],
    "mamba_headdim": lambda sizes: sizes["mamba_expand"] * sizes["hidden_size"] // sizes["n_mamba_heads"],
}


def _tiny_size(name: str, value: int, defaults: dict[str, Any], tied: frozenset[int] = frozenset()) -> int:
    """``value``'s tiny size. An unnamed width equal to the hidden size (or to one of ``tied``: the
    hidden size of the config this one is part of, a vision adapter's output) stays equal to it; a head width
    equal to the rotary width stays equal to it (MLA's ``head_dim``); multi-head latent attention
    (a ``kv_lora_rank``) keeps a key/value head per query head."""
    rope_dims = {size for field, size in defaults.items() if re.search(_ROPE_FIELDS, field)}
    if re.search(r"head_dim$", name) and value in rope_dims:
        return ROPE_DIM
    if re.search(_KV_HEADS_FIELDS, name) and "kv_lora_rank" in defaults:
        return HEADS
    hidden = defaults.get("hidden_size")
    if name.endswith("_hidden_size") and isinstance(hidden, int) and value > hidden and value % hidden == 0:
        return HIDDEN * (value // hidden)  # a multiple of the hidden size (the stream beside the embeddings)
    for pattern, size in _SIZES:
        if re.search(pattern, name):
            return size(value)
    tied_widths = tied | {defaults.get("hidden_size")}
    return HIDDEN if value in tied_widths else value  # a width tied to the hidden size


def _two_layers(values: list | str) -> list | str:
    """A per-layer list (or pattern string) cut to two layers, keeping a second kind of layer where
    there is one: [sliding, sliding, …, full] -> [sliding, full]; "MM-M*" -> "M-"."""
    second = next((index for index, value in enumerate(values) if value != values[0]), 1)
    return values[0] + values[second] if isinstance(values, str) else [values[0], values[second]]


def _layer_indices(indices: list[int], n_layers: int) -> list[int]:
    """Indices of the layers of one kind (attention layers of a hybrid, indexed layers …) among
    ``n_layers``, moved to two layers: the first layer when the kind starts there, the last too or
    instead when it occurs later."""
    return sorted({0 if index == 0 else LAYERS - 1 for index in indices if index < n_layers})


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_config(value: Any) -> bool:
    return hasattr(value, "to_dict") and hasattr(value, "model_type")


def _shrunk(config: PretrainedConfig, tied: frozenset[int] = frozenset()) -> PretrainedConfig:
    """A config of ``config``'s class with tiny sizes; sub-configs (text, vision, audio …) shrunk too,
    a width of theirs equal to a hidden size of the whole (``tied``: the text part's) tied to it."""
    defaults = config.to_dict()
    hidden = getattr(config.get_text_config(decoder=True), "hidden_size", None)
    tied = tied | ({hidden} if isinstance(hidden, int) else set())
    n_layers = defaults.get("num_hidden_layers")
    free_ids = iter(range(VOCAB - 1, len(tiny_vocab()), -1))  # for special ids the tokenizer lacks (images …)
    changes: dict[str, Any] = {
        name: size for name, size in _UNSET.items() if name in defaults and defaults[name] is None
    }
    for name, value in defaults.items():
        if _is_config(vars(config).get(name)):
            changes[name] = _shrunk(vars(config)[name], tied)
        elif name in _SPECIAL_IDS and isinstance(value, (int, list)) and not isinstance(value, bool):
            changes[name] = _SPECIAL_IDS[name]
        elif re.search(r"_token_(id|index)$", name) and isinstance(value, int) and value >= VOCAB:
            changes[name] = next(free_ids)
        elif isinstance(value, int) and not isinstance(value, bool):
            changes[name] = _tiny_size(name, value, defaults, tied)
        elif isinstance(value, list) and len(value) > 1 and len(value) == n_layers and _ints(value):
            per_layer = re.sub(r"_per_layer$", "", name)  # a size per layer (heads per layer): each shrunk
            changes[name] = [_tiny_size(per_layer, int(item), defaults, tied) for item in _two_layers(value)]
        elif isinstance(value, list) and len(value) > 1 and len(value) == n_layers:
            changes[name] = _two_layers(value)
        elif isinstance(value, str) and "pattern" in name and len(value) == n_layers:
            changes[name] = _two_layers(value)
        elif "layer" in name and _ints(value) and value and n_layers and max(value) >= LAYERS:
            changes[name] = _layer_indices(value, n_layers)
        elif name.endswith("types") and _strings(value) and len(set(value)) > 1:  # a repeated pattern
            changes[name] = _two_layers(value)
    sizes = {**defaults, **changes}
    changes |= {name: derive(sizes) for name, derive in _DERIVED.items() if name in defaults}
    return type(config)(**{**changes, **OVERRIDES.get(config.model_type, {})})


_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# What the generic shrink cannot do, per config model type, each with its reason.
OVERRIDES: dict[str, dict[str, Any]] = {
    # its default rope_parameters are empty, and its rotary embedding reads one entry per layer type
    "cohere_compass_text": {"rope_parameters": {"full_attention": _ROPE, "sliding_attention": _ROPE}},
    # its attention reads attn_config.rope_theta, a field the default attention config lacks, and
    # clamps q, k and v to ±clip_qkv, which fails unset (a released config.json sets both)
    "dbrx": {"attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    # its model ties every hybrid layer's shared transformer to the first one's and fails where there
    # is no other (a released checkpoint has 13): a Mamba layer, then two hybrid layers
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # layout embeddings split the hidden size in six (x, y, height, width: four, and twice the shape):
    # a hidden size of 96 divides
    "layoutlmv3": {"hidden_size": 96, "coordinate_size": 16, "shape_size": 16},
    "lilt": {"hidden_size": 96},
    # the default is Mamba only: one attention layer
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # block-sparse attention returns no weights; the full attention it falls back to on short inputs does
    "big_bird": {"attention_type": "original_full"},
    # stacks (input, looped recurrent, output) summing to the layer count; an "mlp" layer type would
    # read as a released checkpoint's separate blocks and halve every count
    "dory": {
        "n_input_layers": 1,
        "n_recurrent_layers": 0,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # no grouped-query attention: as many key/value heads as query heads
    "esmc": {"num_key_value_heads": HEADS},
    # a nested [[kinds, repeats]] pattern: one global layer, one local
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # one layer per stack; num_hidden_layers counts each stack's layer once per cycle (2 · (3 + 1))
    "hrm_text": {"num_layers_per_stack": 1, "num_hidden_layers": 8},
    # a Mamba-2 mixer's heads span its expanded width: 4 heads of 2 · 64 / 4
    "mamba2": {"head_dim": 2 * HIDDEN // HEADS},
    # the sparse indexer reads at most as many heads as one key head serves (4 query heads / 2 kv heads)
    "kolibri1_1": {"index_num_heads": 2},
    # no default layer_types: one short-convolution layer, one attention layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # the causal LM reads one row per codebook: one codebook keeps a [batch, token] input
    "musicgen_decoder": {"num_codebooks": 1},
    "musicgen_melody_decoder": {"num_codebooks": 1},
    # its indexed attention needs every indexer field, and the defaults leave them unset
    "qwen4_exp_text": {
        "indexer_n_heads": HEADS,
        "indexer_kv_heads": 1,
        "indexer_head_dim": HEAD_DIM,
        "indexer_budget": 4,
        "indexer_compress_ratio": 2,
    },
    # axial position embeddings must factor the (shrunk) positions and sum to the hidden size
    "reformer": {"axial_pos_shape": [8, 16], "axial_pos_embds_dim": [32, 32], "attn_layers": ["local", "lsh"]},
    # its step kernel's memory expects query/key heads as wide as value heads
    "xlstm": {"qk_dim_factor": 1.0},
    # the model refuses to run without a language adapter chosen
    "xmod": {"default_language": "en_XX"},
}


# Arguments of a config class whose own default does not pass its validation, per model type: a
# draft model whose default text config has what the draft may not (per-layer inputs, experts).
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma4_assistant": {
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "enable_moe_block": False,
            "use_double_wide_mlp": False,
        }
    },
}


def tiny_config(model_type: str, task: Task = "causal-lm") -> PretrainedConfig:
    """The default config of ``model_type`` with tiny sizes (2 layers, hidden 64, 4 heads, 2 key/value
    heads, head width 16, feed-forward 96, vocabulary 200, 128 positions, 4 experts of which 2 are chosen)
    and the tokenizer's special ids; the text part of a composite config where the ``task`` class loads
    that. Sequence classifiers get 2 labels "neg"/"pos" and a pad id."""
    import transformers

    config = _shrunk(transformers.CONFIG_MAPPING[model_type](**DEFAULTS.get(model_type, {})))
    loaded = model_class(model_type, task).config_class
    if not isinstance(config, loaded) and isinstance(config.get_text_config(decoder=True), loaded):
        config = config.get_text_config(decoder=True)
    if task == "causal-lm" and "is_decoder" in config.to_dict():
        config.is_decoder = True  # an encoder family's causal-LM class runs it with a causal mask
    if config.is_encoder_decoder and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = _SPECIAL_IDS["decoder_start_token_id"]
    if task == "sequence-classification":
        config.num_labels = 2
        config.id2label, config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
        config.pad_token_id = config.get_text_config(decoder=True).pad_token_id = _SPECIAL_IDS["pad_token_id"]
    return config


def model_class(model_type: str, task: Task) -> type[PreTrainedModel]:
    """The transformers class that ``task``'s Auto class builds for ``model_type``."""
    import transformers

    class_name = _mapping(task).get(model_type)
    if class_name is None:
        raise ValueError(f"transformers {transformers.__version__} has no {task} class for {model_type!r}")
    return getattr(transformers, class_name)


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

    config = tiny_config(model_type, task)
    torch.manual_seed(seed)
    model = model_class(model_type, task)._from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomise_constants(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder
