"""Load gates: reload an engine export the way its consumer does and compare draft logits with the trained drafter.

    diff = check("sglang", out_dir, recipe, target, drafter)   # raises ExportError when the consumer would differ

Each gate is a small, independent re-implementation of one consumer's loading path, built only from the exported
directory (the `config.json` fields the consumer reads, with the consumer's defaults when absent; the tensor names
it reads, with its strictness: a parameter it builds but the file lacks keeps a random initialisation, a tensor it
does not know is ignored, a shape it does not build is an error) plus the frozen target (embedding when the file
has none, lm_head). It computes draft logits on a fixed random input (features, token ids, positions, causal) and
`check` compares them with the trained drafter's (`drafter.logits(drafter.predict_features(batch))` for EAGLE,
`drafter.head_logits(hidden)` for Medusa). What the consumer fell back on (a default, a random tensor, a head count)
is named in the error, so the message points at the field.

Consumers reproduced (transformers-4 conventions: `rope_theta` / `rope_scaling`, never `rope_parameters`):
- `medusa`: FasterDecoding Medusa's legacy `MedusaModel.from_pretrained`: `medusa_lm_head.pt` through `torch.load`
  (read here with `weights_only=True`), 5 heads whatever `medusa_num_heads` says, `medusa_num_layers` (default 1)
  copies of ONE shared ResBlock per head (the last `{h}.{l}.linear.*` loaded wins), `load_state_dict(strict=False)`.
- `eagle`: SafeAILab EAGLE-1/2 (`cnets1.py`, `use_eagle3=False`; `pytorch_model.bin` must hold the safetensors
  file's tensors, for the PyPI release that reads only it): fc bias from `bias` (default True), q/k/v biases
  only with a true `qkv_bias`, head_dim = hidden_size // num_attention_heads; its `EConfig` refuses a `rope_scaling`
  other than exactly {type: linear | dynamic, factor: float > 1}, and it builds scaled RoPE on base 10000.
- `sglang`: `LlamaForCausalLMEagle`: fc always with a bias (not checked for presence), `attention_bias` or `bias`
  (default False) as the q/k/v/o attention biases, `head_dim` when given.
- `vllm`: EAGLE drafters as `EagleLlamaForCausalLM` (fc without bias, an `fc.bias` dropped; `attention_bias` or
  `bias` as attention biases, a `qkv_bias` key overriding q/k/v's); Medusa heads as `MedusaModel` (`num_heads`
  default 5, `num_hidden_layers` default 1, block bias only with `medusa_fc_bias`, `lm_heads.0` for every head with
  `original_lm_head`).
All EAGLE layouts: `layers.{i}.*` for `num_hidden_layers` layers, layer 0 without input_layernorm, no final norm,
logits through the target's lm_head; RoPE from `rope_theta` (default 10000) and `rope_scaling` (default, linear and
llama3 are reproduced; another type is refused by the gate rather than guessed).

`native`: `models.io.load_drafter` (eval's strict loader), then the same logits for EAGLE-2 and Medusa drafters.

`GATES`, at the end, lists every gate by layout (the EAGLE-3 ones live in `export.eagle3_layouts`); what all build on
(the gate input, `GateResult`, `Params`, RoPE) is `export.gate_parts`. Adding a gate for a new format: write
`def gate(out_dir, recipe, target, drafter) -> GateResult` and add it to `GATES` ("format-name", or
"format/method" for a method-specific layout); `export.write` runs `check` on every engine format, so one missing
from the table is refused.
The functional consumers (`eagle_consumer_logits`, `medusa_fd_logits`, `vllm_medusa_logits`) take a config dict and
a tensor dict, so `export.imports` verifies imported checkpoints with the same code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from export import eagle3_layouts
from export.gate_parts import (
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
)
from models.io import ExportError, load_drafter, read_json, read_safetensors
from models.methods import METHODS

MEDUSA_PT = "medusa_lm_head.pt"
EAGLE_PT = "pytorch_model.bin"
MEDUSA_SAFETENSORS = "medusa_lm_head.safetensors"
ENGINE_WEIGHTS = "model.safetensors"
FASTERDECODING_HEADS = 5
"""FasterDecoding Medusa's legacy loader builds this many heads whatever `medusa_num_heads` says."""


Gate = Callable[[Path, Any, Any, nn.Module], GateResult]
"""A load gate: (export directory, recipe, target, trained drafter) -> the consumer's and the drafter's logits."""


def tolerance(reference: torch.Tensor, dtype: torch.dtype) -> float:
    """Max abs difference allowed: 1e-4 of the logits' scale in float32, 2e-2 when the drafter or the lm_head it
    projects through is 16-bit (`compute_dtype`; the gate computes in float32 up to the lm_head, which rounds its
    input as the drafter does). Layout errors move logits by far more than either."""
    scale = max(1.0, reference.abs().max().item())
    return (1e-4 if dtype == torch.float32 else 2e-2) * scale


def compute_dtype(drafter: nn.Module, target) -> torch.dtype:
    """float32 when the drafter and the vocabulary projection it drafts through compute in float32, else the 16-bit
    dtype: a float32 EAGLE-1/2 or shared-head Medusa drafter of a bf16 target projects through the target's bf16
    lm_head (its config says so: `borrows_lm_head`); an EAGLE-3 drafter, or Medusa heads with `lm_heads` of their
    own, through their own (among its parameters). The target's embedding only gives rows (exact in any dtype)."""
    borrowed = {target.lm_head.weight.dtype} if drafter.cfg.borrows_lm_head else set()  # not among its parameters
    dtypes = {p.dtype for p in drafter.parameters()} | borrowed
    return next((dt for dt in dtypes if dt != torch.float32), torch.float32)


def check(fmt: str, out_dir: str | Path, recipe, target, drafter: nn.Module) -> float:
    """Run `fmt`'s gate on the export at `out_dir`; return the max abs logit difference, or raise ExportError."""
    if fmt not in GATES:
        raise ExportError(f"export.format: {fmt} has no load gate (export.gates.GATES has {', '.join(sorted(GATES))})")
    was_training = drafter.training
    drafter.eval()
    try:
        with torch.no_grad():
            result = GATES[fmt](Path(out_dir), recipe, target, drafter)
    finally:
        drafter.train(was_training)
    why = "; ".join(result.notes) if result.notes else "no field fell back on a default: check the tensors' values"
    if result.consumer.shape != result.reference.shape:
        raise ExportError(
            f"{fmt} load gate: the consumer computes logits of shape {tuple(result.consumer.shape)}, the trained "
            f"drafter {tuple(result.reference.shape)} ({why})"
        )
    if result.reference.numel() == 0:  # a gate that only reloads (no logits to compare for this method)
        return 0.0
    diff = (result.consumer - result.reference).abs().max().item()
    if not diff <= tolerance(result.reference, compute_dtype(drafter, target)):  # also catches NaN
        raise ExportError(
            f"{fmt} load gate: draft logits of the export as its consumer loads it and of the trained drafter differ "
            f"by {diff:.3g} ({why})"
        )
    return diff


# --------------------------------------------------------------------------------------------
# Reading an export as a consumer does


def same_tensors(out_dir: Path, safetensors_name: str, pt_name: str, fmt: str) -> dict[str, torch.Tensor]:
    """An export's safetensors file and its `.pt` copy (for loaders that read only that) hold the same tensors;
    returns them (each file read once)."""
    a, b = read_safetensors(out_dir / safetensors_name), read_pt(out_dir / pt_name)
    if a.keys() != b.keys() or any(not torch.equal(a[k], b[k]) for k in a):
        raise ExportError(f"{fmt} load gate: {safetensors_name} and {pt_name} hold different tensors")
    return b


def read_pt(path: Path) -> dict[str, torch.Tensor]:
    """A `.pt` state dict as `torch.load(path, weights_only=True)` reads it: tensors only, never arbitrary pickle."""
    if not path.is_file():
        raise ExportError(f"{path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle's, torch's or an OSError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"{path}: not loadable with torch.load(weights_only=True) ({first})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise ExportError(f"{path}: expected a dict of named tensors, got {type(state).__name__}")
    return state


# --------------------------------------------------------------------------------------------
# EAGLE-1/2 layouts: one functional Llama drafter, with each consumer's rules


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


# --------------------------------------------------------------------------------------------
# Medusa layouts


def medusa_hidden(drafter: nn.Module, d: int) -> torch.Tensor:
    """(B, T, d) float32 last hidden states (the heads cast them to their compute dtype)."""
    dev = next(drafter.parameters()).device
    gen = torch.Generator().manual_seed(GATE_SEED)
    return torch.randn(GATE_BATCH, GATE_LEN, d, generator=gen).to(dev)


def medusa_fd_logits(
    config: dict,
    tensors: dict[str, torch.Tensor],
    where: str,
    hidden: torch.Tensor,
    vocab: int,
    notes: list[str],
    num_heads: int = FASTERDECODING_HEADS,
) -> torch.Tensor:
    """(num_heads, B, T, V) as FasterDecoding's legacy loader builds the heads: per head `[ResBlock] * L` (one
    shared block: of `{h}.{l}.linear.*` the last one loaded wins) and `{h}.{L}.weight`; strict=False."""
    d = hidden.shape[-1]
    L = int(config_value(config, "medusa_num_layers", 1, notes))
    p = Params(tensors, where, hidden.device, notes)
    x0 = hidden.float()
    out = []
    for h in range(num_heads):
        w = b = None
        for layer in range(L):  # the same module under L names: each load overwrites the previous
            if f"{h}.{layer}.linear.weight" in tensors:
                w = p.get(f"{h}.{layer}.linear.weight", (d, d))
            if f"{h}.{layer}.linear.bias" in tensors:
                b = p.get(f"{h}.{layer}.linear.bias", (d,))
        if w is None:
            w = p.get(f"{h}.0.linear.weight", (d, d), "zeros")  # ResBlock zero-initialises its weight
        if b is None:
            b = p.get(f"{h}.0.linear.bias", (d,))
        x = x0
        for _ in range(L):
            x = x + F.silu(F.linear(x, w, b))
        out.append(F.linear(x, p.get(f"{h}.{L}.weight", (vocab, d))))
    return torch.stack(out)


def medusa_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    config = read_json(out_dir / "config.json")
    tensors = same_tensors(out_dir, MEDUSA_SAFETENSORS, MEDUSA_PT, "medusa")  # the loader reads the .pt
    notes: list[str] = []
    if drafter.cfg.num_heads != FASTERDECODING_HEADS:
        notes.append(
            f"medusa_num_heads: the consumer builds {FASTERDECODING_HEADS} heads, "
            f"the drafter has {drafter.cfg.num_heads}"
        )
    if config.get("medusa_num_layers", 1) > 1:
        notes.append("medusa_num_layers: the consumer shares one ResBlock across a head's layers")
    hidden = medusa_hidden(drafter, target.config.hidden_size)
    consumer = medusa_fd_logits(config, tensors, MEDUSA_PT, hidden, target.config.vocab_size, notes)
    return GateResult(consumer, drafter.head_logits(hidden).float(), notes)


def vllm_medusa_logits(
    config: dict, tensors: dict[str, torch.Tensor], where: str, hidden: torch.Tensor, notes: list[str]
) -> torch.Tensor:
    """(K, B, T, V) as vLLM's `MedusaModel` builds the heads from its config fields (defaults when absent)."""
    d = int(config_value(config, "hidden_size", 4096, notes))
    vocab = int(config_value(config, "vocab_size", 32001, notes))
    truncated = config.get("truncated_vocab_size") or vocab
    if truncated != vocab:
        raise ExportError(f"{where}: truncated_vocab_size {truncated} != vocab_size {vocab}: no token_map is written")
    K = int(config_value(config, "num_heads", 5, notes))
    L = int(config_value(config, "num_hidden_layers", 1, notes))
    bias = bool(config.get("medusa_fc_bias", False))
    shared = bool(config.get("original_lm_head", False))
    p = Params(tensors, where, hidden.device, notes)
    out = []
    for h in range(K):
        x = hidden.float()
        for layer in range(L):
            w = p.get(f"blocks.{h}.layers.{layer}.weight", (d, d))
            b = p.get(f"blocks.{h}.layers.{layer}.bias", (d,)) if bias else None
            x = x + F.silu(F.linear(x, w, b))
        out.append(F.linear(x, p.get(f"lm_heads.{0 if shared else h}.weight", (vocab, d))))
    return torch.stack(out)


def vllm_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    if METHODS[drafter.cfg.method].proposer == "eagle":  # EAGLE-1/2 drafters go out in the SafeAILab layout
        return eagle_gate(out_dir, target, drafter, VLLM_EAGLE)
    config = read_json(out_dir / "config.json")
    tensors = read_safetensors(out_dir / ENGINE_WEIGHTS)
    hidden = medusa_hidden(drafter, target.config.hidden_size)
    notes: list[str] = []
    consumer = vllm_medusa_logits(config, tensors, ENGINE_WEIGHTS, hidden, notes)
    return GateResult(consumer, drafter.head_logits(hidden).float(), notes)


def safeailab_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    tensors = same_tensors(out_dir, ENGINE_WEIGHTS, EAGLE_PT, "eagle")  # the PyPI release reads only the .bin
    return eagle_gate(out_dir, target, drafter, SAFEAILAB, tensors)


def sglang_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    return eagle_gate(out_dir, target, drafter, SGLANG)


def native_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """`models.io.load_drafter` (what eval runs: strict names, shapes and frozen tensors), then the same draft
    logits for EAGLE-2 drafters and Medusa heads (what their method declares: `models.methods`); a method with its
    own gate registers `native/<method>` (EAGLE-3: `export.eagle3_layouts`), others get the strict reload only."""
    reloaded = load_drafter(out_dir, target)
    method = METHODS[drafter.cfg.method]
    if method.proposer == "eagle" and not method.own_vocab:
        batch, _, _ = eagle_inputs(drafter, target.config.vocab_size, target.config.hidden_size)
        return GateResult(
            reloaded.logits(reloaded.predict_features(batch)).float(), drafter.logits(drafter.predict_features(batch))
        )
    if method.proposer == "medusa":
        hidden = medusa_hidden(drafter, target.config.hidden_size)
        return GateResult(reloaded.head_logits(hidden).float(), drafter.head_logits(hidden).float())
    return GateResult(torch.zeros(0), torch.zeros(0), ["no logit comparison for this method: strict reload only"])


# --------------------------------------------------------------------------------------------
# Every load gate, by export layout: a format, or "<format>/<method>" for a method-specific layout (`export.write`)

GATES: dict[str, Gate] = {
    "native": native_gate,
    "medusa": medusa_gate,
    "eagle": safeailab_gate,
    "sglang": sglang_gate,
    "vllm": vllm_gate,
    "native/eagle3": eagle3_layouts.native_eagle3_gate,
    "speculators/eagle3": eagle3_layouts.speculators_gate,
    "vllm/eagle3": eagle3_layouts.speculators_gate,  # vLLM reads the speculators layout natively
    "sglang/eagle3": eagle3_layouts.sglang_eagle3_gate,
    "native/peagle": eagle3_layouts.native_eagle3_gate,  # the same comparison: one forward with its mask slots
    "speculators/peagle": eagle3_layouts.peagle_gate,
    "vllm/peagle": eagle3_layouts.peagle_gate,
}
