"""The load gates of EAGLE-3 and P-EAGLE exports: one functional EAGLE-3 drafter parameterised by each consumer's
reading rules (`Eagle3Reader`: vLLM, the speculators package, SGLang; P-EAGLE's mask slots), which reloads an export
from its files as that consumer does and must give the trained drafter's draft logits. Methods name them in their
`methods` entries."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

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
from methods.eagle3.layouts import ENGINE_FUSED, WEIGHTS, hf_index
from models.io import ExportError, load_drafter, read_json, read_safetensors


@dataclass(frozen=True)
class Eagle3Reader:
    name: str
    layer_prefixes: tuple[str, ...]
    """Names the consumer loads its first layer from (the first one present wins)."""
    aux_offset: int
    """HF hidden-state index = aux id + aux_offset."""
    reads_flags: bool
    """It honours fc_norm / norm_output / norm_before_residual."""
    residual_default: bool
    """norm_before_residual when the config has none."""
    speculators_config: bool
    """The Llama layer config sits under `transformer_layer_config` (else at the top level)."""
    loads_config_dtype: bool = False
    """It loads every tensor in the config's `dtype` as transformers' `from_pretrained(dtype="auto")` does: without
    one, in the dtype of the file's first floating-point tensor (names sorted). The engines run the drafter in
    their serving dtype instead."""
    fused: int | None = None
    """How many hidden states its fc reads whatever the config lists (None: as many as the aux ids)."""
    multi_layer: bool = True
    """It builds the config's `num_hidden_layers` decoder layers, the ones after the first plain pre-norm Llama layers
    over the stream (`layers.{i}.*`); False: it reads one layer and refuses a config of more."""
    parallel: bool = False
    """P-EAGLE (`speculators_model_type: peagle`): after the real positions it runs `speculative_tokens - 1` mask
    slots (`mask_hidden` through fc, the `mask_token_id` embedding) instead of one step fed back; `fc_norm` is read
    from the layer config, `norm_before_residual` defaults to false."""


VLLM_SPECULATORS = Eagle3Reader(
    "vLLM (speculators config)", ("layers.0.", "midlayer."), 0, True, True, True, fused=ENGINE_FUSED
)


SPECULATORS = Eagle3Reader("speculators Eagle3DraftModel", ("layers.0.",), 0, True, False, True, True)


SGLANG = Eagle3Reader(
    "SGLang LlamaForCausalLMEagle3", ("midlayer.",), 1, False, False, False, fused=ENGINE_FUSED, multi_layer=False
)


VLLM_PEAGLE = Eagle3Reader(
    "vLLM (speculators peagle config)", ("layers.0.", "midlayer."), 0, True, False, True, fused=ENGINE_FUSED,
    parallel=True,
)  # fmt: skip


def from_pretrained_dtype(config: dict, tensors: dict[str, torch.Tensor], notes: list[str]) -> torch.dtype:
    """The dtype transformers' `from_pretrained(dtype="auto")` loads a checkpoint in (see `loads_config_dtype`)."""
    name = config.get("dtype") or config.get("torch_dtype")
    if name is not None:
        dtype = getattr(torch, str(name).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ExportError(f"config.json: dtype {name!r} is not a torch dtype")
        return dtype
    first = next((k for k in sorted(tensors) if tensors[k].is_floating_point()), None)
    if first is None:
        return torch.float32
    dtype = tensors[first].dtype
    if dtype != torch.float32:
        name = str(dtype).removeprefix("torch.")
        notes.append(f"config.json has no dtype: every tensor is loaded in {first}'s {name}")
    return dtype


def eagle3_consumer_logits(
    config: dict,
    tensors: dict[str, torch.Tensor],
    reader: Eagle3Reader,
    target,
    hidden: torch.Tensor,
    next_ids: torch.Tensor,
    positions: torch.Tensor,
    extra: tuple[torch.Tensor, torch.Tensor],
    notes: list[str],
) -> torch.Tensor:
    """Draft logits over the target vocabulary (-inf off the draft vocabulary) as `reader` builds the drafter:
    (B, T + 1, V): T causal positions from the target's hidden states `hidden` (B, T, L+1, d, every HF index), then
    one more draft step at the last position fed the drafter's own output, reading token `extra[0]` (B,) at
    position `extra[1]` (B,); for a parallel reader (B, T + S, V), the S mask slots after the T positions instead."""
    top = config
    layer = config.get("transformer_layer_config") if reader.speculators_config else config
    if not isinstance(layer, dict):
        raise ExportError(f"config.json: transformer_layer_config is {layer!r}, {reader.name} needs a dict")
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if not isinstance(layer.get(key), int):
            raise ExportError(f"config.json: {key} is {layer.get(key)!r}, {reader.name} needs an integer")
    d, H, m = layer["hidden_size"], layer["num_attention_heads"], layer["intermediate_size"]
    Hkv = layer.get("num_key_value_heads") or H
    hd = layer.get("head_dim") or d // H
    eps = float(config_value(layer, "rms_norm_eps", 1e-6, notes))
    n_layers = layer.get("num_hidden_layers", 1)
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ExportError(f"config.json: num_hidden_layers is {n_layers!r}, {reader.name} needs an integer >= 1")
    if n_layers > 1 and not reader.multi_layer:
        raise ExportError(f"config.json: num_hidden_layers is {n_layers}, {reader.name} builds one decoder layer")
    L = target.config.num_hidden_layers
    eagle_config = top.get("eagle_config") or {}
    ids = top.get("eagle_aux_hidden_state_layer_ids") if reader.speculators_config else None
    ids = ids or eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = [2, L // 2, L - 3]
        notes.append(f"no eagle_aux_hidden_state_layer_ids ({reader.name} captures {ids})")
        index = ids
    else:
        index = [i + reader.aux_offset for i in ids]
    lo = reader.aux_offset  # vLLM: inputs of layers 0..L-1 (HF 0..L-1); SGLang: outputs of layers 0..L-2 (HF 1..L-1)
    if any(not lo <= i <= L - 1 for i in index):
        raise ExportError(
            f"config.json: aux layer ids {ids} are out of range: {reader.name} captures ids 0..{L - 1 - lo} of a "
            f"{L}-layer target"
        )
    if sorted(set(index)) != index:  # the target's layer loop captures each listed layer once, in layer order
        notes.append(f"aux layer ids {ids} are captured in layer order, once each")
        index = sorted(set(index))
    if reader.fused is not None and len(index) != reader.fused:
        raise ExportError(
            f"config.json: {len(index)} aux layer ids {ids}: {reader.name}'s fc reads exactly {reader.fused} hidden "
            "states (the first draft step fails)"
        )
    K = top.get("draft_vocab_size") or layer.get("vocab_size")
    flags = {"fc_norm": False, "norm_output": False, "norm_before_residual": reader.residual_default}
    if reader.parallel:
        flags["fc_norm"] = bool(layer.get("fc_norm", False))
        flags["norm_before_residual"] = bool(config_value(top, "norm_before_residual", False, notes))
    elif reader.reads_flags:
        for key, default in flags.items():
            flags[key] = bool(config_value(top, key, default, notes) if key == "norm_before_residual" else
                              top.get(key, default))  # fmt: skip
    dev = hidden.device
    if reader.loads_config_dtype:
        dtype = from_pretrained_dtype(top, tensors, notes)
        tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}
    p = Params(tensors, WEIGHTS, dev, notes)
    pre = next((x for x in reader.layer_prefixes if any(k.startswith(x) for k in tensors)), reader.layer_prefixes[0])
    embed = tensors.get("embed_tokens.weight")
    embed = target.embed_tokens.weight if embed is None else embed
    feats = hidden[:, :, index].float()  # (B, T, 3, d)
    B, T = next_ids.shape
    if reader.parallel:  # the mask slots' fc input joins the features: the same FC-Norm and fc
        if "mask_token_id" not in top:
            raise ExportError(f"config.json: no mask_token_id: {reader.name} refuses the config (KeyError)")
        if "mask_hidden" not in tensors:
            raise ExportError(f"{WEIGHTS}: no mask_hidden: {reader.name} refuses to load (ValueError)")
        slots = top["speculators_config"]["proposal_methods"][0]["speculative_tokens"] - 1
        mask_hidden = tensors["mask_hidden"].to(dev, torch.float32)
        if mask_hidden.numel() != len(index) * feats.shape[-1]:
            raise ExportError(f"{WEIGHTS}: mask_hidden has {mask_hidden.numel()} values, fc reads {len(index)} x d")
        feats = torch.cat([feats, mask_hidden.view(1, 1, len(index), -1).expand(B, slots, -1, -1)], dim=1)
    if flags["fc_norm"]:
        feats = torch.stack([_rms(feats[:, :, i], p.get(f"fc_norm.{i}.weight", (d,), "ones"), eps) for i in
                             range(len(index))], dim=2)  # fmt: skip
    elif any(k.startswith("fc_norm.") for k in tensors):
        notes.append(f"fc_norm.* tensors are ignored: {reader.name} applies no FC-Norm")
    g = F.linear(feats.flatten(2), p.get("fc.weight", (d, len(index) * d)))  # (B, T, d)

    def layer_weights(prefix: str, d_in: int) -> dict[str, torch.Tensor]:
        return {
            n: p.get(prefix + n + ".weight", shape, init)
            for n, shape, init in (
                ("input_layernorm", (d,), "ones"),
                ("post_attention_layernorm", (d,), "ones"),
                ("self_attn.q_proj", (H * hd, d_in), "random"),
                ("self_attn.k_proj", (Hkv * hd, d_in), "random"),
                ("self_attn.v_proj", (Hkv * hd, d_in), "random"),
                ("self_attn.o_proj", (d, H * hd), "random"),
                ("mlp.gate_proj", (m, d), "random"),
                ("mlp.up_proj", (m, d), "random"),
                ("mlp.down_proj", (d, m), "random"),
            )
        }

    w = {**layer_weights(pre, 2 * d), "hidden_norm": p.get(pre + "hidden_norm.weight", (d,), "ones")}
    upper = [layer_weights(f"layers.{i}.", d) for i in range(1, n_layers)]  # layers 1..: [embedding; g] not re-read
    norm_w = p.get("norm.weight", (d,), "ones")
    head = p.get("lm_head.weight", (K, d))
    d2t = tensors.get("d2t")
    if d2t is None:
        notes.append("no d2t: draft ids are read as target ids")
        d2t = torch.zeros(K, dtype=torch.int64)
    draft_to_target = torch.arange(K) + d2t.to(torch.int64)
    if int(draft_to_target.max()) >= target.config.vocab_size or int(draft_to_target.min()) < 0:
        raise ExportError(f"{WEIGHTS}: d2t maps draft ids outside the target vocabulary (ids instead of offsets?)")

    caches: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]  # per layer: keys, values so far

    def block(w: dict, residual: torch.Tensor, x: torch.Tensor, pos, mask, cache: list) -> torch.Tensor:
        """One decoder layer: attention over x (B, n, d_in) added to `residual`, then the MLP."""
        n = x.shape[1]
        q = F.linear(x, w["self_attn.q_proj"]).view(B, n, H, hd).transpose(1, 2)
        k = F.linear(x, w["self_attn.k_proj"]).view(B, n, Hkv, hd).transpose(1, 2)
        v = F.linear(x, w["self_attn.v_proj"]).view(B, n, Hkv, hd).transpose(1, 2)
        cos, sin = rope_cos_sin(layer, hd, pos, notes)
        q, k = _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1) @ v
        h = residual + F.linear(att.transpose(1, 2).reshape(B, n, H * hd), w["self_attn.o_proj"])
        x = _rms(h, w["post_attention_layernorm"], eps)
        return h + F.linear(F.silu(F.linear(x, w["mlp.gate_proj"])) * F.linear(x, w["mlp.up_proj"]), w["mlp.down_proj"])

    def run(g: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        emb = embed[ids.to(embed.device)].to(dev, torch.float32)
        normed_g = _rms(g, w["hidden_norm"], eps)
        residual = normed_g if flags["norm_before_residual"] else g
        x = torch.cat([_rms(emb, w["input_layernorm"], eps), normed_g], dim=-1)
        h = block(w, residual, x, pos, mask, caches[0])
        for i, wi in enumerate(upper, start=1):
            h = block(wi, h, _rms(h, wi["input_layernorm"], eps), pos, mask, caches[i])
        normed = _rms(h, norm_w, eps)
        return normed, (normed if flags["norm_output"] else h)

    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril().expand(B, T, T)
    normed0, fed = run(g[:, :T], next_ids, positions, causal)
    if reader.parallel:  # mask slot j at the last position + j sees the real prefix and slots 1..j
        ids = torch.full((B, slots), int(top["mask_token_id"]), dtype=torch.long, device=dev)
        pos = positions[:, -1:].to(dev) + 1 + torch.arange(slots, device=dev)
        seen = torch.ones(B, slots, T, dtype=torch.bool, device=dev)
        mask = torch.cat([seen, torch.ones(slots, slots, dtype=torch.bool, device=dev).tril().expand(B, -1, -1)], -1)
        normed1, _ = run(g[:, T:], ids, pos, mask)
    else:
        token, pos = extra
        seen = torch.ones(B, 1, T + 1, dtype=torch.bool, device=dev)
        normed1, _ = run(fed[:, -1:], token[:, None], pos[:, None], seen)
    draft = F.linear(torch.cat([normed0, normed1], dim=1), head)  # (B, T + steps after, K)
    out = torch.full((*draft.shape[:2], target.config.vocab_size), float("-inf"), device=dev)
    out[..., draft_to_target.to(dev)] = draft
    return out


def eagle3_inputs(drafter: nn.Module, num_layers: int, vocab: int):
    """The gate's fixed input: every HF hidden-state index of a random 'target' (B, T, L+1, d), next tokens,
    positions (rows far apart: RoPE errors show) and one extra draft step's token and position."""
    gen = torch.Generator().manual_seed(GATE_SEED)
    d = drafter.fc.out_features
    hidden = torch.randn(GATE_BATCH, GATE_LEN, num_layers + 1, d, generator=gen)
    next_ids = torch.randint(0, vocab, (GATE_BATCH, GATE_LEN), generator=gen)
    positions = torch.arange(GATE_LEN).expand(GATE_BATCH, GATE_LEN) + ROW_OFFSET * torch.arange(GATE_BATCH)[:, None]
    token = torch.randint(0, vocab, (GATE_BATCH,), generator=gen)
    return hidden, next_ids, positions, token, positions[:, -1] + 1


@torch.no_grad()
def drafter_logits(drafter: nn.Module, hidden, next_ids, positions, token, pos, parallel: bool = False) -> torch.Tensor:
    """The trained drafter on the gate's input, the same two steps (`parallel`, a P-EAGLE drafter: its one forward
    over the positions and its `parallel_tokens - 1` mask slots), mapped to the target vocabulary."""
    dev = next(drafter.parameters()).device
    L = hidden.shape[2] - 1
    index = [hf_index(layer, L) for layer in drafter.cfg.feature_layers]
    feats = hidden[:, :, index].flatten(2).to(dev)
    cache = drafter.new_cache()
    if parallel:
        B, slots = next_ids.shape[0], drafter.cfg.parallel_tokens - 1
        feats = torch.cat([feats, drafter.mask_hidden.to(feats.dtype).expand(B, slots, -1)], dim=1)
        ids = torch.cat([next_ids.to(dev), torch.full((B, slots), drafter.cfg.mask_token_id, device=dev)], dim=1)
        pos = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(slots)], dim=1).to(dev)
        draft = drafter.step(feats, ids, pos, cache)[0].float()  # causal: slot j sees the positions, slots 1..j
    else:
        logits0, h = drafter.step(feats, next_ids.to(dev), positions.to(dev), cache)
        logits1, _ = drafter.step(h[:, -1:], token[:, None].to(dev), pos[:, None].to(dev), cache, from_target=False)
        draft = torch.cat([logits0, logits1], dim=1).float()
    out = torch.full((*draft.shape[:2], drafter.target_vocab_size), float("-inf"), device=dev)
    out[..., drafter.draft_ids] = draft
    return out


def finite_pairs(consumer: torch.Tensor, reference: torch.Tensor, notes: list[str]) -> GateResult:
    """Compare on the reference's draft tokens; a consumer that maps draft ids elsewhere gets NaN (a failure)."""
    keep = torch.isfinite(reference[0, 0])
    if not torch.equal(torch.isfinite(consumer[0, 0]), keep):
        notes.append("d2t maps the draft vocabulary to other target tokens than the drafter's")
        consumer = torch.full_like(consumer, float("nan"))
    return GateResult(consumer[..., keep].float(), reference[..., keep].float(), notes)


def eagle3_gate(out_dir: Path, target, drafter: nn.Module, reader: Eagle3Reader) -> GateResult:
    config = read_json(out_dir / "config.json")
    return compare(config, read_safetensors(out_dir / WEIGHTS), reader, target, drafter)


def compare(config: dict, tensors: dict, reader: Eagle3Reader, target, drafter: nn.Module) -> GateResult:
    """`reader`'s logits from (config, tensors) against `drafter`'s, on the gate's fixed input."""
    hidden, next_ids, positions, token, pos = eagle3_inputs(
        drafter, target.config.num_hidden_layers, target.config.vocab_size
    )
    notes: list[str] = []
    consumer = eagle3_consumer_logits(config, tensors, reader, target, hidden, next_ids, positions, (token, pos), notes)
    reference = drafter_logits(drafter, hidden, next_ids, positions, token, pos, reader.parallel)
    return finite_pairs(consumer, reference, notes)


def speculators_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """The speculators package's Eagle3DraftModel and vLLM's reading of the same files must both agree."""
    vllm = eagle3_gate(out_dir, target, drafter, VLLM_SPECULATORS)
    spec = eagle3_gate(out_dir, target, drafter, SPECULATORS)
    worst = max((vllm, spec), key=lambda r: float((r.consumer - r.reference).abs().max().nan_to_num(float("inf"))))
    return worst


def sglang_eagle3_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    return eagle3_gate(out_dir, target, drafter, SGLANG)


def native_gate(out_dir: Path, target, drafter: nn.Module, parallel: bool) -> GateResult:
    """`models.io.load_drafter` (eval's strict loader), then the same draft steps over the target vocabulary."""
    reloaded = load_drafter(out_dir, target)
    inputs = eagle3_inputs(drafter, target.config.num_hidden_layers, target.config.vocab_size)
    return finite_pairs(drafter_logits(reloaded, *inputs, parallel), drafter_logits(drafter, *inputs, parallel), [])


def native_eagle3_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """A native EAGLE-3 export, strictly reloaded: its two draft steps."""
    return native_gate(out_dir, target, drafter, parallel=False)
