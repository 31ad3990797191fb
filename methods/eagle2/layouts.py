"""EAGLE-1/2 in the engines' layouts: SafeAILab's (`eagle`), SGLang's (`sglang`) and vLLM's (`vllm`) `LlamaForCausalLM`
EAGLE configs and weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from export.gate_parts import EAGLE_PT, ENGINE_WEIGHTS
from export.write import VOLATILE_CONFIG_KEYS
from methods.medusa1.layouts import write_pt
from models.io import (
    ExportError,
    legacy_rope,
    write_safetensors,
)
from models.target import Target
from schema.recipe import Recipe


def write_vllm_eagle(
    out: Path, recipe: Recipe, target: Target, drafter: nn.Module, include_target_weights: bool
) -> None:
    """vLLM: an EAGLE-1/2 drafter in the SafeAILab layout, which vLLM's `method: eagle` reads (vLLM wraps the Llama
    config itself). vLLM builds that drafter's fc without a bias and skips weights it has no parameter for, so
    drafters trained with an fc bias are refused, not exported wrong."""
    check_eagle_layout(drafter.cfg)  # first what no EAGLE-1/2 layout holds, then what vLLM's cannot
    if drafter.cfg.fc_bias:
        raise ExportError(
            "export.format: vllm builds the EAGLE fc without bias and would silently drop fc.bias; train with "
            "drafter.fc_bias=false, or export --format eagle / sglang (which keep the bias)"
        )
    _write_eagle(out, target, drafter, include_target_weights, "vllm")


def check_eagle_layout(cfg) -> None:
    """Refuse an EAGLE drafter that no EAGLE-1/2 layout (`eagle`, `sglang`, `vllm`) can hold."""
    if cfg.fc_norm or cfg.post_norm or cfg.feature_layers != [-1]:
        raise ExportError(
            "export.format: the EAGLE-1/2 layout has no FC-Norm, post-norm or feature fusion; train with "
            "drafter.fc_norm=false drafter.post_norm=false drafter.feature_layers=[-1], or export --format native"
        )


def _write_eagle(out: Path, target: Target, drafter: nn.Module, include_target_weights: bool, fmt: str) -> None:
    """The EAGLE-1/2 layout for `fmt`: "eagle" (SafeAILab), "vllm" (which reads SafeAILab's layout through
    transformers' config) or "sglang"."""
    cfg = drafter.cfg
    check_eagle_layout(cfg)
    tensors = dict(drafter.trainable_state_dict())
    if include_target_weights:  # engines then use this copy instead of the target's embedding
        tensors["embed_tokens.weight"] = drafter.embed_tokens.weight
    sglang = fmt == "sglang"
    if sglang and "fc.bias" not in tensors:  # SGLang's fc always has a bias: load zeros, not its initial values
        tensors["fc.bias"] = torch.zeros(tensors["fc.weight"].shape[0], dtype=tensors["fc.weight"].dtype)
    write_safetensors(tensors, out / ENGINE_WEIGHTS)
    if fmt == "eagle":  # SafeAILab's PyPI release (eagle-llm 1.2.1) reads only this file
        write_pt(tensors, out / EAGLE_PT)
    config = {k: v for k, v in target.config.to_dict().items() if k not in VOLATILE_CONFIG_KEYS | _BIAS_KEYS}
    # the drafter's layers have no attention or MLP biases, whatever the target's have
    arch = SGLANG_EAGLE if sglang else SAFEAILAB_EAGLE
    config.update(architectures=[arch], num_hidden_layers=cfg.num_layers, tie_word_embeddings=False)
    config.update(attention_bias=False, mlp_bias=False)
    # the drafter's own layers: a SiLU MLP and full causal attention, whatever the target's layers have (a copied
    # per-layer `layer_types` list of the target's length is refused by transformers, so by vLLM and SGLang)
    config["hidden_act"] = "silu"
    config.pop("hidden_activation", None)
    if "layer_types" in config:
        config["layer_types"] = ["full_attention"] * cfg.num_layers
    if "sliding_window" in config:
        config.update(sliding_window=None, use_sliding_window=False)
    config.update(legacy_rope(config))
    if fmt == "eagle":
        safeailab_rope(config)
        if config.get("rope_theta", 10000.0) != 10000.0:
            print(
                f"note: rope_theta {config['rope_theta']}: SafeAILab's current code reads it; its PyPI release "
                "(eagle-llm 1.2.1) builds RoPE on base 10000 whatever the config says and drafts wrong logits",
                file=sys.stderr,
            )
    if not sglang:  # SafeAILab reads `bias` as the fc's; SGLang's Llama layers would read it as attention biases
        config["bias"] = cfg.fc_bias
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")


SGLANG_EAGLE = "LlamaForCausalLMEagle"

SAFEAILAB_EAGLE = "LlamaForCausalLM"

_BIAS_KEYS = {"bias", "qkv_bias"}


def safeailab_rope(config: dict) -> None:
    """Rewrite `rope_scaling` the one way SafeAILab's EConfig accepts ({"type", "factor"}, linear or dynamic), or
    refuse what it cannot build: any other scaling, or scaling on a base other than 10000 (it ignores rope_theta
    when scaling)."""
    scaling = config.get("rope_scaling")
    if not scaling:
        return
    kind, theta = scaling["type"], config.get("rope_theta", 10000.0)
    if kind not in ("linear", "dynamic") or theta != 10000.0:
        why = f"RoPE type {kind!r}" if kind not in ("linear", "dynamic") else f"scaled RoPE on rope_theta {theta}"
        raise ExportError(
            f"export.format: SafeAILab EAGLE-1/2 builds linear or dynamic RoPE scaling on base 10000 only, the target "
            f"has {why}; export --format vllm or sglang"
        )
    config["rope_scaling"] = {"type": kind, "factor": float(scaling["factor"])}


def write_eagle(out: Path, recipe: Recipe, target: Target, drafter: nn.Module, include_target_weights: bool) -> None:
    _write_eagle(out, target, drafter, include_target_weights, "eagle")


def write_sglang(out: Path, recipe: Recipe, target: Target, drafter: nn.Module, include_target_weights: bool) -> None:
    _write_eagle(out, target, drafter, include_target_weights, "sglang")
