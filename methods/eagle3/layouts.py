"""EAGLE-3 engine layouts: how `export.write` writes an `eagle3` drafter for each consumer, and how the load gate
reloads it the way that consumer does.

Formats (`python -m export RUN_DIR --format speculators|sglang|vllm`):
- `speculators` (and `vllm`, which writes the same files: vLLM reads this layout natively): `config.json` with
  `speculators_model_type: eagle3`, `transformer_layer_config` (the drafter's Llama layer, `vocab_size` = the
  target's), `draft_vocab_size`, `target_hidden_size`, `eagle_aux_hidden_state_layer_ids` (vLLM numbering: id i =
  the input of decoder layer i = HF hidden-state index i), `norm_before_residual` (always written: vLLM's reader
  defaults it to true, the speculators package to false), the EAGLE-3.1 flags `fc_norm`, `norm_output`,
  `norm_before_fc`, `dtype` (the trained tensors': without it the package loads every tensor in the stored
  embedding's, bf16 for a bf16 target) and `speculators_config` (greedy proposal, `speculative_tokens`, the
  verifier's name).
  Tensors `embed_tokens.weight` (an exact copy of the target's: the speculators package has no other source for
  it), `fc.weight`, `fc_norm.{i}.weight`, `layers.0.*` (with `hidden_norm`; with `drafter.num_layers` > 1 the plain
  Llama layers after it, `layers.1.*`, ..., and `transformer_layer_config.num_hidden_layers`), `norm.weight`,
  `lm_head.weight`, `d2t` (offsets: target id = draft id + d2t[draft id]) and `t2d`.
- `sglang`: `LlamaForCausalLMEagle3`, a one-layer Llama config with `draft_vocab_size` and `eagle_config`
  (`eagle_aux_hidden_state_layer_ids` in SGLang's numbering: id i = the output of decoder layer i = HF index i+1).
  Tensors under `midlayer.*` (SGLang drops `layers.0.*` names without a word), `fc.weight`, `norm.weight`,
  `lm_head.weight`, `d2t`, `t2d`; the target's embedding is shared. SGLang's EAGLE-3 layer has no FC-Norm, no
  post-norm output and always adds the raw feature as the residual, so drafters trained with `fc_norm`,
  `norm_output` or `norm_before_residual` are refused for it, as are feature layers it cannot capture and drafters of
  more than one decoder layer.
Both carry the target's `max_position_embeddings` and RoPE settings (`rope_theta`, a legacy `rope_scaling` and
`rope_parameters`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from models.io import ExportError, legacy_rope, write_safetensors

WEIGHTS = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose loader was checked (`benchmarks/speculators_check.py`)."""
SGLANG_EAGLE3 = "LlamaForCausalLMEagle3"
ENGINE_FUSED = 3
"""vLLM's and SGLang's EAGLE-3 fc read this many auxiliary hidden states (3 × target_hidden_size inputs)."""


# --------------------------------------------------------------------------------------------
# Auxiliary layer ids: each engine numbers the captured hidden states its own way


def hf_index(layer: int, num_layers: int) -> int:
    """A hidden-state index (HF `output_hidden_states`, -1 = the last) as a non-negative index 0..L."""
    return layer if layer >= 0 else num_layers + 1 + layer


def aux_layer_ids(feature_layers: list[int], num_layers: int, engine: str) -> list[int]:
    """The ids `engine` ("vllm" or "sglang") captures `feature_layers` under, in the drafter's order; ExportError for a
    layer it cannot capture or for two that are the same hidden state.

    vLLM (and speculators): id i = the input of decoder layer i, HF index i, for i in 0..L-1. SGLang: id i = the
    output of decoder layer i, HF index i+1, for i in 0..L-2 (the last layer's output reaches HF's hidden states only
    after the final norm, which no engine captures)."""
    ids = []
    for layer in feature_layers:
        i = hf_index(layer, num_layers)
        lo, hi = (0, num_layers - 1) if engine == "vllm" else (1, num_layers - 1)
        if not lo <= i <= hi:
            raise ExportError(
                f"drafter.feature_layers: hidden state {layer} (index {i} of 0..{num_layers}) cannot be captured by "
                f"{engine}, which reads indices {lo}..{hi} of a {num_layers}-layer target"
            )
        ids.append(i if engine == "vllm" else i - 1)
    if len(set(ids)) != len(ids):
        raise ExportError(
            f"drafter.feature_layers: {feature_layers} name one hidden state twice; {engine} captures it once"
        )
    return ids


def in_layer_order(tensors: dict[str, torch.Tensor], ids: list[int]) -> list[int]:
    """Engines capture the auxiliary hidden states in layer order, whatever order the config lists them in: permute
    `fc.weight`'s input blocks, the `fc_norm.{i}` weights and P-EAGLE's `mask_hidden` chunks (in place) from the
    drafter's feature order to ascending ids; -> the sorted ids."""
    order = sorted(range(len(ids)), key=ids.__getitem__)
    if order != list(range(len(ids))):
        w = tensors["fc.weight"]
        tensors["fc.weight"] = w.view(w.shape[0], len(ids), -1)[:, order].reshape(w.shape)
        if "mask_hidden" in tensors:  # P-EAGLE: the mask slots' fc input, one chunk per aux state
            mask = tensors["mask_hidden"]
            tensors["mask_hidden"] = mask.reshape(len(ids), -1)[order].reshape(mask.shape)
        norms = {i: tensors.pop(f"fc_norm.{i}.weight") for i in range(len(ids)) if f"fc_norm.{i}.weight" in tensors}
        for new, old in enumerate(order):
            if old in norms:
                tensors[f"fc_norm.{new}.weight"] = norms[old]
    return sorted(ids)


def layer_config(target_config, num_layers: int = 1) -> dict:
    """The drafter's decoder layers as a Llama config dict (target sizes, RoPE, context length)."""
    c = target_config
    rope = dict(getattr(c, "rope_parameters", None) or {})
    out = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
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
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": rope,
    }
    out.update(legacy_rope({"rope_parameters": rope}))  # the same transformers-4 RoPE fields as EAGLE-1/2 layouts
    return out


# --------------------------------------------------------------------------------------------
# Writers


def _tensors(drafter: nn.Module, layer_prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in drafter.trainable_state_dict().items():
        out[name.replace("midlayer.", layer_prefix, 1) if name.startswith("midlayer.") else name] = tensor
    return out


def write_speculators(out: Path, recipe, target, drafter: nn.Module, include_target_weights: bool) -> None:
    """An EAGLE-3 drafter in the speculators layout (vLLM's `eagle3`)."""
    write_speculators_layout(out, recipe, target, drafter, parallel=False)


def write_speculators_layout(out: Path, recipe, target, drafter: nn.Module, parallel: bool) -> None:
    cfg, tc = drafter.cfg, target.config
    if len(cfg.feature_layers) != ENGINE_FUSED:
        raise ExportError(
            f"drafter.feature_layers: vLLM's EAGLE-3 fc reads exactly {ENGINE_FUSED} hidden states, got "
            f"{cfg.feature_layers}; export --format native"
        )
    tensors = _tensors(drafter, "layers.0.")
    ids = in_layer_order(tensors, aux_layer_ids(cfg.feature_layers, tc.num_hidden_layers, "vllm"))
    tensors["embed_tokens.weight"] = drafter.embed_tokens.weight  # exact copy: the package has no other source
    if parallel:  # speculators' PEagleDraftModel parameter shape, (1, 1, n_feat·d): its loader refuses (n_feat·d,)
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, 1, -1)  # vLLM reads any shape (view(1, -1))
    write_safetensors(tensors, out / WEIGHTS)
    layer = layer_config(tc, cfg.num_layers)
    if parallel:  # vLLM's peagle reading copies no fc_norm from the top level: its layer config carries it
        layer["fc_norm"] = cfg.fc_norm
    config = {
        "architectures": ["PeagleDraftModel" if parallel else "Eagle3DraftModel"],
        "speculators_model_type": cfg.method,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab,
        "target_hidden_size": tc.hidden_size,
        "eagle_aux_hidden_state_layer_ids": ids,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "embed_requires_grad": False,
        # the trained tensors' dtype: from_pretrained would otherwise load all in the first stored (the embedding's)
        "dtype": str(drafter.compute_dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": cfg.method,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    # P-EAGLE: every token one forward drafts (vLLM appends speculative_tokens - 1 mask slots)
                    "speculative_tokens": cfg.parallel_tokens if parallel else max(recipe.eval.tree_depth, 1),
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
    if parallel:
        config["mask_token_id"] = cfg.mask_token_id
        del config["norm_output"]  # no draft step reads another's output
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")


def write_sglang_eagle3(out: Path, recipe, target, drafter: nn.Module, include_target_weights: bool) -> None:
    cfg, tc = drafter.cfg, target.config
    if cfg.num_layers > 1:
        raise ExportError(
            f"export.format: sglang's EAGLE-3 drafter has one decoder layer (drafter.num_layers is {cfg.num_layers}); "
            "export --format speculators (read by vLLM)"
        )
    flags = {"fc_norm": cfg.fc_norm, "norm_output": cfg.norm_output, "norm_before_residual": cfg.norm_before_residual}
    for flag, on in flags.items():
        if on:
            raise ExportError(
                f"export.format: sglang's EAGLE-3 layer has no {flag} (drafter.{flag} is true); export --format "
                "speculators (read by vLLM) or train with it false"
            )
    if len(cfg.feature_layers) != ENGINE_FUSED:
        raise ExportError(
            f"drafter.feature_layers: sglang fuses exactly {ENGINE_FUSED} hidden states, got {cfg.feature_layers}"
        )
    tensors = _tensors(drafter, "midlayer.")
    ids = in_layer_order(tensors, aux_layer_ids(cfg.feature_layers, tc.num_hidden_layers, "sglang"))
    if include_target_weights:
        tensors["embed_tokens.weight"] = drafter.embed_tokens.weight
    write_safetensors(tensors, out / WEIGHTS)
    config = layer_config(tc)
    config.update(
        architectures=[SGLANG_EAGLE3],
        draft_vocab_size=cfg.draft_vocab,
        target_hidden_size=tc.hidden_size,
        eagle_config={"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    )
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
