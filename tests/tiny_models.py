"""Tiny random-weight models of every family, built from configs (no hub).

Each has 2 layers, 4 heads, hidden 32 and a small WordPiece tokenizer made locally
(`attnflow.rows.tiny.tiny_tokenizer`), and is saved to a folder so that it loads through
`attnflow.load(path)` like a user's model. Used by the
`tiny_model_path` fixture (tests/conftest.py) and importable by tests as ``tiny_models``.
"""

from __future__ import annotations

from pathlib import Path

from attnflow.rows.tiny import tiny_tokenizer


def tiny_config(family: str):
    import transformers as T

    text = dict(vocab_size=160, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4)
    ids = dict(pad_token_id=0, bos_token_id=2, eos_token_id=3)
    configs = {
        "bert": lambda: T.BertConfig(**text),
        "roberta": lambda: T.RobertaConfig(**text, max_position_embeddings=66, pad_token_id=0),
        "electra": lambda: T.ElectraConfig(**text, embedding_size=32),
        "distilbert": lambda: T.DistilBertConfig(vocab_size=160, dim=32, n_layers=2, n_heads=4, hidden_dim=37),
        "mpnet": lambda: T.MPNetConfig(**text, max_position_embeddings=66, pad_token_id=0),
        "gpt2": lambda: T.GPT2Config(vocab_size=160, n_embd=32, n_layer=2, n_head=4, n_positions=64, **ids),
        "llama": lambda: T.LlamaConfig(**text, num_key_value_heads=2, max_position_embeddings=64, **ids),
        # Qwen2: Llama's layout plus biases on q, k and v; grouped-query attention (2 kv heads).
        "qwen2": lambda: T.Qwen2Config(**text, num_key_value_heads=2, max_position_embeddings=64, **ids),
        # Gemma 3: sandwich norms, q/k norms, a local layer (window of GEMMA3_WINDOW tokens) then a global one.
        "gemma3": lambda: T.Gemma3TextConfig(
            **text,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=GEMMA3_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=64,
            **ids,
        ),
        # Architectural variants (rows registered by the tests: tests/variant_rows.py). Phi: parallel
        # attention and feed-forward, one LayerNorm, partial rotary; GPT-J: parallel, no attention biases.
        "phi": lambda: T.PhiConfig(**text, partial_rotary_factor=0.5, max_position_embeddings=64, **ids),
        "gptj": lambda: T.GPTJConfig(
            vocab_size=160, n_embd=32, n_layer=2, n_head=4, n_inner=37, rotary_dim=4, n_positions=64, **ids
        ),
        # OLMo-2: post-norms only (x + norm(attention(x)), x + norm(mlp(x))), q/k norms over the whole projection.
        "olmo2": lambda: T.Olmo2Config(**text, max_position_embeddings=64, **ids),
        # Gemma 2: sandwich norms; soft-capping small enough to bite on tiny logits.
        "gemma2": lambda: T.Gemma2Config(
            **text,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=GEMMA3_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            attn_logit_softcapping=GEMMA2_SOFTCAP,
            final_logit_softcapping=GEMMA2_SOFTCAP,
            max_position_embeddings=64,
            **ids,
        ),
        # GPT-OSS: attention sinks (a learned logit per head in the softmax), a mixture of experts.
        "gpt_oss": lambda: T.GptOssConfig(
            **(text | {"intermediate_size": 32}),
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=GEMMA3_WINDOW,
            max_position_embeddings=64,
            **ids,
        ),
        "vit": lambda: T.ViTConfig(**vision, intermediate_size=37),
        "deit": lambda: T.DeiTConfig(**vision, intermediate_size=37),
        "dinov2": lambda: T.Dinov2Config(**vision, mlp_ratio=1),
        "t5": lambda: T.T5Config(
            vocab_size=160, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, decoder_start_token_id=0, **ids
        ),
        "bart": lambda: T.BartConfig(
            vocab_size=160,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=37,
            decoder_ffn_dim=37,
            max_position_embeddings=64,
            decoder_start_token_id=2,
            forced_eos_token_id=None,
            **ids,
        ),
        **_moe_configs(T, ids),
    }
    return configs[family]()


def _moe_configs(T, ids: dict) -> dict:
    """Mixtures of experts: 4 experts, 2 chosen per token; Qwen2-MoE adds a gated shared expert."""
    moe = dict(
        vocab_size=160,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=24,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        **ids,
    )
    return {
        "mixtral": lambda: T.MixtralConfig(**moe, num_local_experts=4),
        "qwen2_moe": lambda: T.Qwen2MoeConfig(
            **moe, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=20
        ),
        "olmoe": lambda: T.OlmoeConfig(**moe, num_experts=4),
    }


TEXT_FAMILIES = ("bert", "roberta", "electra", "distilbert", "mpnet", "gpt2", "llama", "qwen2", "gemma3", "t5", "bart")
DECODER_FAMILIES = ("gpt2", "llama", "qwen2", "gemma3")
GEMMA3_WINDOW = 3  # tokens a local layer of the tiny Gemma 3 sees: itself and the 2 before it
# Families with no built-in row: the tests register theirs (tests/variant_rows.py) around loading.
VARIANT_FAMILIES = ("phi", "gptj", "olmo2", "gemma2", "gpt_oss")
GEMMA2_SOFTCAP = 0.5  # the tiny Gemma 2's attention-logit and final-logit soft-capping
VISION_FAMILIES = ("vit", "deit", "dinov2")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "olmoe")  # no built-in row: `moe_row` is their hand row


def moe_row(family: str):
    """A hand row for a tiny mixture of experts: the Llama row with the MoE block for its MLP."""
    import dataclasses

    from attnflow.rows import ADAPTERS, Experts

    llama = next(row for row in ADAPTERS if row.family == "llama")
    shared = dict(shared="shared_expert", shared_gate="shared_expert_gate") if family == "qwen2_moe" else {}
    experts = Experts(r"layers\.(\d+)\.mlp$", **shared)
    return dataclasses.replace(llama, family=f"tiny-{family}", model_types=(family,), gated_mlp=None, experts=experts)


CLASSIFIER_FAMILIES = ("bert", "roberta", "electra", "distilbert", "mpnet")


def build_tiny_classifier(family: str, folder: Path) -> Path:
    """A tiny random ``*ForSequenceClassification`` (2 classes, labels "neg"/"pos") of a BERT-like family."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    config = tiny_config(family)
    config.num_labels = 2
    config.id2label, config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
    model = T.AutoModelForSequenceClassification.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


# Parameters that a family initialises to constants which would hide a mistake: Gemma's norms compute
# x·(1 + w) with w = 0 (a norm read as x·w would pass), Qwen2's q/k/v biases start at 0 (a value
# vector captured without its bias would pass); every 1-D parameter (norms, biases) of the variants
# and of the mixtures of experts.
_RANDOMISED = {"gemma3": ("norm", "weight"), "qwen2": ("_proj", "bias")} | dict.fromkeys(
    VARIANT_FAMILIES + MOE_FAMILIES, ("", "")
)


def _randomise_constants(family: str, model) -> None:
    import torch

    if family not in _RANDOMISED:
        return
    part, kind = _RANDOMISED[family]
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if part in name and name.endswith(kind) and parameter.dim() == 1:
                parameter.add_(0.3 * torch.randn_like(parameter))


def build_tiny_model(family: str, folder: Path) -> Path:
    import torch
    import transformers as T

    torch.manual_seed(0)
    config = tiny_config(family)
    auto = dict.fromkeys(DECODER_FAMILIES + VARIANT_FAMILIES + MOE_FAMILIES, T.AutoModelForCausalLM)
    auto |= dict.fromkeys(("t5", "bart"), T.AutoModelForSeq2SeqLM)
    eager = {"attn_implementation": "eager"} if family in VARIANT_FAMILIES else {}
    model = auto.get(family, T.AutoModel).from_config(config, **eager)
    _randomise_constants(family, model)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if family not in VISION_FAMILIES:
        tiny_tokenizer().save_pretrained(folder)
    return folder
