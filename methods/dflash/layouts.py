"""DFlash in the speculators layout, which vLLM reads (`speculators_model_type: dflash`): `config.json` with the
decoder layers as a Qwen3 config, the aux layers, the mask token, the block; `model.safetensors` with `fc`,
`hidden_norm`, `norm` and `layers.{i}.*` (every layer's key norm, a tied one copied), no embedding or lm_head (the
target's are shared at load)."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from export.gate_parts import ENGINE_WEIGHTS
from models.io import legacy_rope, write_safetensors

SPECULATORS_VERSION = "0.9.0"


def layer_config(target_config, num_layers: int) -> dict:
    """The drafter's decoder layers as the Qwen3 config vLLM builds them from: the target's sizes and RoPE, full
    attention in every layer."""
    c = target_config
    rope = dict(getattr(c, "rope_parameters", None) or {})
    out = {
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "num_hidden_layers": num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "rope_parameters": rope,
    }
    out.update(legacy_rope({"rope_parameters": rope}))  # explicit theta: vLLM's Qwen3 default (1e6) is not ours
    return out


def engine_tensors(drafter: nn.Module) -> dict:
    """The trained tensors under the layout's names: a tied key norm written into every layer."""
    tensors = dict(drafter.trainable_state_dict())
    shared = "layers.0.self_attn.k_norm.weight"
    for i in range(1, drafter.cfg.num_layers):
        tensors.setdefault(f"layers.{i}.self_attn.k_norm.weight", tensors[shared])
    return tensors


def write_speculators_dflash(out: Path, recipe, target, drafter: nn.Module, include_target_weights: bool) -> None:
    cfg, tc = drafter.cfg, target.config
    write_safetensors(engine_tensors(drafter), out / ENGINE_WEIGHTS)
    config = {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config(tc, cfg.num_layers),
        "aux_hidden_state_layer_ids": list(drafter.feature_layers),  # HF hidden-state indices: the engines' aux ids
        "mask_token_id": cfg.mask_token_id,
        "block_size": cfg.block_size,
        "draft_vocab_size": tc.vocab_size,
        "target_hidden_size": tc.hidden_size,
        "sliding_window_non_causal": True,  # the block attends to itself both ways, as trained (vLLM: causal=false)
        "sample_from_anchor": False,
        "tie_word_embeddings": False,
        "dtype": str(drafter.compute_dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.block_size - 1,  # vLLM's num_speculative_tokens
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": recipe.target.path or target.name,
                "architectures": list(getattr(tc, "architectures", None) or ["LlamaForCausalLM"]),
            },
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
