"""A model's architecture from its transformers config: the shapes the tensor-parallel split
and the KV calculator (:mod:`workbench.kvcalc`) both start from.

It sits in the model layer so that :mod:`workbench.model.parallel` checks a split without importing
the calculator (which pulls in its command line).
"""

from __future__ import annotations

from workbench.catalog import ModelArch

#: config keys of a mixture-of-experts model (its weight size is not modelled)
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def arch_from_hf_config(cfg, name: str, source: str) -> ModelArch:
    """A :class:`ModelArch` from a transformers config (a multimodal one: its text config).

    Raises:
        ValueError: a mixture-of-experts config (its weight size is not modelled), or a field is missing.
    """
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    mt = getattr(cfg, "model_type", None) or "unknown"
    if any(getattr(cfg, k, None) for k in _MOE_KEYS):
        raise ValueError(
            f"{source}: model_type={mt!r} is a mixture-of-experts model; kv-calc models dense Llama-family "
            "architectures (Llama, Mistral, Qwen2 and the like)"
        )
    try:
        h, heads, layers = cfg.hidden_size, cfg.num_attention_heads, cfg.num_hidden_layers
        inter, vocab = cfg.intermediate_size, cfg.vocab_size
    except AttributeError as e:
        raise ValueError(f"{source}: the config lacks a field kv-calc needs ({e})") from None
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return ModelArch(
        name=name,
        hidden_size=h,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", None) or 0,
        qkv_bias=attention_bias or mt == "qwen2",  # transformers' Qwen2Attention always has q/k/v bias
        o_bias=attention_bias,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        model_type=mt,
        source=source,
    )
