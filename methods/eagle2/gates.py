"""The load gates of EAGLE-1/2 exports: one functional Llama drafter parameterised by each consumer's rules
(`EagleRules`: SafeAILab's EAGLE, SGLang's `LlamaForCausalLMEagle`, vLLM's `EagleLlamaForCausalLM`), which reloads an
export from its files as that consumer does and must give the trained drafter's draft logits. `export.gates` lists
them; `export.imports` verifies imported checkpoints with `eagle_consumer_logits`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from export.gate_parts import (
    EAGLE_PT,
    ENGINE_WEIGHTS,
    GATE_BATCH,
    GATE_LEN,
    GATE_SEED,
    ROW_OFFSET,
    GateResult,
    Params,
    _rms,
    _rotate,
    config_value,
    rope_cos_sin,
    same_tensors,
)
from models.io import ExportError, load_drafter, read_json, read_safetensors


@dataclass(frozen=True)
class EagleRules:
    name: str
    fc_bias: Callable[[dict, list], bool]
    attn_bias: Callable[[dict, list], tuple[bool, bool]]
    """(q/k/v biases, o_proj bias) the consumer builds from the config."""
    head_dim: Callable[[dict, list], int]
    check_config: Callable[[dict], None] = lambda config: None
    """Raises ExportError for a config the consumer refuses to load."""
    scaled_rope_reads_theta: bool = True
    """False: the consumer builds scaled RoPE (a `rope_scaling`) on base 10000, whatever `rope_theta` says."""
    length_dependent_ntk: bool = False
    """True: the consumer builds dynamic (NTK) RoPE as transformers does, the base growing with the sequence."""


def _head_dim_given(config: dict, notes: list) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _llama_attention_bias(config: dict, notes: list) -> tuple[bool, bool]:
    """vLLM's Llama layer: `attention_bias` or `bias` for every projection; a `qkv_bias` key overrides q/k/v's."""
    bias = bool(config.get("attention_bias", False) or config.get("bias", False))
    return (bool(config["qkv_bias"]) if "qkv_bias" in config else bias), bias


def _econfig_check(config: dict) -> None:
    """SafeAILab's `EConfig` refuses a `rope_scaling` other than exactly {"type": "linear" | "dynamic", "factor":
    a float > 1}."""
    scaling = config.get("rope_scaling")
    if scaling is None:
        return
    good = isinstance(scaling, dict) and len(scaling) == 2 and scaling.get("type") in ("linear", "dynamic")
    factor = scaling.get("factor") if isinstance(scaling, dict) else None
    if not (good and isinstance(factor, float) and factor > 1.0):
        raise ExportError(
            f"config.json: rope_scaling {scaling!r}: SafeAILab's EConfig refuses it (it takes exactly "
            "{'type': 'linear' or 'dynamic', 'factor': a float > 1}), so the load fails"
        )


SAFEAILAB = EagleRules(
    "SafeAILab EAGLE-1/2",
    fc_bias=lambda c, n: bool(config_value(c, "bias", True, n)),
    attn_bias=lambda c, n: (bool(c.get("qkv_bias", False)), False),
    head_dim=lambda c, n: c["hidden_size"] // c["num_attention_heads"],
    check_config=_econfig_check,
    scaled_rope_reads_theta=False,
    length_dependent_ntk=True,  # its own copy of transformers' dynamic NTK rotary embedding
)


def _transformers_check(config: dict) -> None:
    """vLLM and SGLang read config.json through transformers' `AutoConfig`: a config it refuses (e.g. a `layer_types`
    list of another length than `num_hidden_layers`) fails their load."""
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    try:
        AutoConfig.for_model(config.get("model_type", "llama"), **fields)
    except Exception as exc:  # transformers raises ValueError, KeyError and its own validation errors
        why = next((line.strip() for line in reversed(str(exc).splitlines()) if line.strip()), type(exc).__name__)
        msg = f"config.json: transformers' AutoConfig (how vLLM and SGLang read it) refuses it: {why}"
        raise ExportError(msg) from None


SGLANG = EagleRules(
    "SGLang LlamaForCausalLMEagle",
    fc_bias=lambda c, n: True,
    attn_bias=lambda c, n: (bool(c.get("attention_bias", False) or c.get("bias", False)),) * 2,
    head_dim=_head_dim_given,
    check_config=_transformers_check,
)


VLLM_EAGLE = EagleRules(
    "vLLM EagleLlamaForCausalLM",
    fc_bias=lambda c, n: False,
    attn_bias=_llama_attention_bias,
    head_dim=_head_dim_given,
    check_config=_transformers_check,
)


def eagle_consumer_logits(
    config: dict,
    tensors: dict[str, torch.Tensor],
    where: str,
    rules: EagleRules,
    target,
    features: torch.Tensor,
    next_ids: torch.Tensor,
    positions: torch.Tensor,
    notes: list[str],
) -> torch.Tensor:
    """Draft logits (B, T, V) of an EAGLE-1/2 drafter as `rules`' consumer builds it from (config, tensors):
    fc(cat(embed(next_ids), features)) -> Llama layers (layer 0 without input norm) -> target lm_head. Causal."""
    dev = features.device
    rules.check_config(config)
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if not isinstance(config.get(key), int):
            raise ExportError(f"{where}: config.json: {key} is {config.get(key)!r}, the consumer needs an integer")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ExportError(f"{where}: config.json: hidden_act {act!r}: the load gate reproduces silu only")
    d, H, m = config["hidden_size"], config["num_attention_heads"], config["intermediate_size"]
    Hkv = config.get("num_key_value_heads") or H
    hd = rules.head_dim(config, notes)
    eps = float(config_value(config, "rms_norm_eps", 1e-6, notes))
    layers = int(config_value(config, "num_hidden_layers", 1, notes))
    p = Params(tensors, where, dev, notes)
    embed = tensors.get("embed_tokens.weight")
    embed = target.embed_tokens.weight if embed is None else embed
    if embed.shape[-1] != d:
        raise ExportError(f"{where}: embed_tokens.weight has shape {tuple(embed.shape)}, the consumer builds d={d}")
    fc_w = p.get("fc.weight", (d, 2 * d))
    fc_b = p.get("fc.bias", (d,)) if rules.fc_bias(config, notes) else None
    if fc_b is None and "fc.bias" in tensors:
        notes.append(f"fc.bias in {where} is dropped: {rules.name} builds fc without a bias")
    rows = embed[next_ids.to(embed.device)].to(dev, torch.float32)  # (B, T, d): index first, cast only the rows
    h = F.linear(torch.cat([rows, features.float()], dim=-1), fc_w, fc_b)  # (B, T, d)
    B, T, _ = h.shape
    cos, sin = rope_cos_sin(config, hd, positions, notes, rules.scaled_rope_reads_theta, rules.length_dependent_ntk)
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hd)
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    qkv_bias, o_bias = rules.attn_bias(config, notes)
    for i in range(layers):
        pre = f"layers.{i}."
        x = h if i == 0 else _rms(h, p.get(pre + "input_layernorm.weight", (d,), "ones"), eps)

        def proj(name: str, out: int, x: torch.Tensor, inp: int = d, pre: str = pre) -> torch.Tensor:
            w = p.get(f"{pre}self_attn.{name}.weight", (out, inp))
            biased = o_bias if name == "o_proj" else qkv_bias
            b = p.get(f"{pre}self_attn.{name}.bias", (out,)) if biased else None
            return F.linear(x, w, b)

        q = proj("q_proj", H * hd, x).view(B, T, H, hd).transpose(1, 2)
        k = proj("k_proj", Hkv * hd, x).view(B, T, Hkv, hd).transpose(1, 2)
        v = proj("v_proj", Hkv * hd, x).view(B, T, Hkv, hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v  # (B, H, T, hd)
        h = h + proj("o_proj", d, att.transpose(1, 2).reshape(B, T, H * hd), H * hd)
        x = _rms(h, p.get(pre + "post_attention_layernorm.weight", (d,), "ones"), eps)
        gate = F.linear(x, p.get(pre + "mlp.gate_proj.weight", (m, d)))
        up = F.linear(x, p.get(pre + "mlp.up_proj.weight", (m, d)))
        h = h + F.linear(F.silu(gate) * up, p.get(pre + "mlp.down_proj.weight", (d, m)))
    head = target.lm_head  # in its own dtype, as the consumer (and the drafter's `logits`) projects
    return head(h.to(head.weight.device, head.weight.dtype)).float().to(dev)  # (B, T, V)


def eagle_inputs(drafter: nn.Module, vocab: int, d: int | None = None) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The gate's fixed input: a batch for the drafter, and (features, next_ids) as a consumer reads them."""
    dev = next(drafter.parameters()).device
    gen = torch.Generator().manual_seed(GATE_SEED)
    d = d or drafter.fc.in_features // 2
    n_stored = len(drafter.stored_layers)
    hidden = torch.randn(GATE_BATCH, GATE_LEN, n_stored, d, generator=gen)
    ids = torch.randint(0, vocab, (GATE_BATCH, GATE_LEN), generator=gen)
    positions = torch.arange(GATE_LEN).expand(GATE_BATCH, GATE_LEN) + ROW_OFFSET * torch.arange(GATE_BATCH)[:, None]
    batch = {
        "hidden": hidden.to(dev, drafter.compute_dtype),
        "input_ids": ids.to(dev),
        "position_ids": positions.to(dev),
        "attention_mask": torch.ones(GATE_BATCH, GATE_LEN, dtype=torch.long, device=dev),
        "loss_mask": torch.ones(GATE_BATCH, GATE_LEN, device=dev),
    }
    last = drafter.stored_layers.index(-1) if -1 in drafter.stored_layers else 0
    features = batch["hidden"][:, :, last]  # EAGLE-1/2: the last hidden state
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1).to(dev)  # x_{t+1}, as the drafter's training path
    return batch, features, next_ids


def rope_hints(config: dict, target_config) -> list[str]:
    """Where the export's transformers-4 RoPE fields disagree with the target's (the drafter was trained with those)."""
    rope = dict(getattr(target_config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(target_config, "rope_theta", None))
    kind = rope.get("rope_type", "default")
    scaling = config.get("rope_scaling") or {}
    hints = []
    if theta is not None and config.get("rope_theta", 10000.0) != theta:
        hints.append(f"config.json rope_theta is {config.get('rope_theta')!r}, the target's {theta}")
    if scaling.get("rope_type", scaling.get("type", "default")) != kind:
        hints.append(f"config.json rope_scaling is {config.get('rope_scaling')!r}, the target's RoPE type {kind!r}")
    return hints


def eagle_gate(
    out_dir: Path, target, drafter: nn.Module, rules: EagleRules, tensors: dict[str, torch.Tensor] | None = None
) -> GateResult:
    """`tensors`: the export's weights when the caller has read them already."""
    if drafter.cfg.feature_layers != [-1]:
        raise ExportError(
            f"{rules.name} reads the last hidden state only; drafter.feature_layers is {drafter.cfg.feature_layers}"
        )
    config = read_json(out_dir / "config.json")
    tensors = read_safetensors(out_dir / ENGINE_WEIGHTS) if tensors is None else tensors
    batch, features, next_ids = eagle_inputs(drafter, target.config.vocab_size)
    notes = rope_hints(config, target.config)
    consumer = eagle_consumer_logits(
        config, tensors, ENGINE_WEIGHTS, rules, target, features, next_ids, batch["position_ids"], notes
    )
    reference = drafter.logits(drafter.predict_features(batch))
    return GateResult(consumer.float(), reference.float(), notes)


def safeailab_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    tensors = same_tensors(out_dir, ENGINE_WEIGHTS, EAGLE_PT, "eagle")  # the PyPI release reads only the .bin
    return eagle_gate(out_dir, target, drafter, SAFEAILAB, tensors)


def sglang_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    return eagle_gate(out_dir, target, drafter, SGLANG)


def vllm_eagle_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """vLLM's `EagleLlamaForCausalLM` reading the SafeAILab layout (`--format vllm` of an EAGLE-1/2 drafter)."""
    return eagle_gate(out_dir, target, drafter, VLLM_EAGLE)


def native_eagle_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """`models.io.load_drafter` (what eval runs: strict names, shapes and frozen tensors), then the same draft
    logits on the gate's input."""
    reloaded = load_drafter(out_dir, target)
    batch, _, _ = eagle_inputs(drafter, target.config.vocab_size, target.config.hidden_size)
    return GateResult(
        reloaded.logits(reloaded.predict_features(batch)).float(), drafter.logits(drafter.predict_features(batch))
    )
