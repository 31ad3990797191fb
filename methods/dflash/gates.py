"""DFlash's load gates: the native export strictly reloaded, and the speculators layout read as vLLM and the
speculators package compute it (written here from their documented semantics, not imported), each against the
trained drafter on the same input: two rows of target features far apart in position, one block after each."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from export.gate_parts import (
    ENGINE_WEIGHTS,
    GATE_BATCH,
    GATE_LEN,
    GATE_SEED,
    ROW_OFFSET,
    GateResult,
    Params,
    _rms,
    _rotate,
    rope_cos_sin,
)
from models.io import ExportError, load_drafter, read_json, read_safetensors


def gate_inputs(drafter: nn.Module, num_layers: int, vocab: int):
    """Every HF hidden-state index of a random 'target' (B, T, L + 1, d), the roots, the context positions."""
    gen = torch.Generator().manual_seed(GATE_SEED)
    d = drafter.fc.out_features
    hidden = torch.randn(GATE_BATCH, GATE_LEN, num_layers + 1, d, generator=gen)
    roots = torch.randint(0, vocab, (GATE_BATCH,), generator=gen)
    positions = torch.arange(GATE_LEN).expand(GATE_BATCH, GATE_LEN) + ROW_OFFSET * torch.arange(GATE_BATCH)[:, None]
    return hidden, roots, positions


@torch.no_grad()
def drafter_logits(drafter: nn.Module, hidden: torch.Tensor, roots: torch.Tensor, positions: torch.Tensor):
    """The drafter's block logits over the target vocabulary (B, K, V), float32, as its proposer drafts them."""
    device, out = drafter.fc.weight.device, []
    stored = hidden[:, :, [i if i >= 0 else hidden.shape[2] - 1 for i in drafter.stored_layers]].to(device)
    for b in range(hidden.shape[0]):
        pos = positions[b : b + 1].to(device)
        context = drafter.context_kv(drafter.context(stored[b : b + 1]), pos)
        normed = drafter.draft_block(roots[b : b + 1].to(device), int(pos[0, -1]) + 1, context)
        out.append(drafter.lm_head(normed.to(drafter.lm_head.weight.dtype)).float()[0].cpu())
    return torch.stack(out)


def native_dflash_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """`models.io.load_drafter` (eval's strict loader), then the same blocks."""
    reloaded = load_drafter(out_dir, target)
    inputs = gate_inputs(drafter, target.config.num_hidden_layers, target.config.vocab_size)
    return GateResult(drafter_logits(reloaded, *inputs), drafter_logits(drafter, *inputs), [])


def consumer_logits(config: dict, tensors: dict, target, hidden, roots, positions, notes: list[str]) -> torch.Tensor:
    """The block logits (B, K, V) as vLLM's DFlash computes them from the speculators layout, in float32."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ExportError(f"config.json: transformer_layer_config: expected an object, got {layer!r:.60}")
    for key in ("aux_hidden_state_layer_ids", "mask_token_id", "speculators_config"):
        if key not in config:
            raise ExportError(f"config.json: no {key} (vLLM's speculators reader requires it)")
    d, eps = layer["hidden_size"], layer["rms_norm_eps"]
    H, Hkv = layer["num_attention_heads"], layer.get("num_key_value_heads") or layer["num_attention_heads"]
    hd, L = layer.get("head_dim") or d // H, layer["num_hidden_layers"]
    K = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    causal = not config.get("sliding_window_non_causal", False)
    if causal:
        notes.append("sliding_window_non_causal is false: vLLM attends causally inside the block")
    params = Params(tensors, ENGINE_WEIGHTS, torch.device("cpu"), notes)
    ids = sorted(config["aux_hidden_state_layer_ids"])  # the engines capture each once, in layer order
    n = len(ids)
    fc = params.get("fc.weight", (d, n * d))
    hidden_norm = params.get("hidden_norm.weight", (d,), "ones")
    norm = params.get("norm.weight", (d,), "ones")
    embed = target.embed_tokens.weight.detach().float().cpu()
    head = target.lm_head.weight.detach().float().cpu()
    theta_cfg = dict(layer)
    if "rope_theta" not in theta_cfg:
        notes.append("no rope_theta in transformer_layer_config: vLLM's Qwen3 default 1e6")
        theta_cfg["rope_theta"] = 1e6
    out = []
    for b in range(hidden.shape[0]):
        ctx_pos = positions[b : b + 1]
        p = int(ctx_pos[0, -1]) + 1
        c = _rms(hidden[b, :, ids].flatten(1).float() @ fc.T, hidden_norm, eps)  # (T, d)
        block_ids = torch.tensor([int(roots[b])] + [config["mask_token_id"]] * K)
        x = embed[block_ids]  # (K + 1, d)
        block_pos = torch.arange(p, p + K + 1)[None]
        cos_c, sin_c = (t[0] for t in rope_cos_sin(theta_cfg, hd, ctx_pos, notes))
        cos_b, sin_b = (t[0] for t in rope_cos_sin(theta_cfg, hd, block_pos, []))
        for i in range(L):
            pre = f"layers.{i}."
            ffn = layer["intermediate_size"]
            shapes = {
                "self_attn.q_proj.weight": (H * hd, d),
                "self_attn.k_proj.weight": (Hkv * hd, d),
                "self_attn.v_proj.weight": (Hkv * hd, d),
                "self_attn.o_proj.weight": (d, H * hd),
                "mlp.gate_proj.weight": (ffn, d),
                "mlp.up_proj.weight": (ffn, d),
                "mlp.down_proj.weight": (d, ffn),
            }
            norms = {
                "self_attn.q_norm.weight": (hd,),
                "self_attn.k_norm.weight": (hd,),
                "input_layernorm.weight": (d,),
                "post_attention_layernorm.weight": (d,),
            }
            w = {k: params.get(pre + k, s) for k, s in shapes.items()} | {
                k: params.get(pre + k, s, "ones") for k, s in norms.items()}  # fmt: skip
            u = _rms(x, w["input_layernorm.weight"], eps)
            qn, kn = w["self_attn.q_norm.weight"], w["self_attn.k_norm.weight"]
            q = _heads(u @ w["self_attn.q_proj.weight"].T, H, hd, qn, eps, cos_b, sin_b)
            kc = _heads(c @ w["self_attn.k_proj.weight"].T, Hkv, hd, kn, eps, cos_c, sin_c)  # no input norm
            kb = _heads(u @ w["self_attn.k_proj.weight"].T, Hkv, hd, kn, eps, cos_b, sin_b)
            vc = (c @ w["self_attn.v_proj.weight"].T).view(-1, Hkv, hd).transpose(0, 1)
            vb = (u @ w["self_attn.v_proj.weight"].T).view(-1, Hkv, hd).transpose(0, 1)
            k = torch.cat([kc, kb], dim=1).repeat_interleave(H // Hkv, dim=0)
            v = torch.cat([vc, vb], dim=1).repeat_interleave(H // Hkv, dim=0)
            scores = q @ k.transpose(1, 2) / hd**0.5  # (H, K + 1, T + K + 1)
            if causal:
                T = c.shape[0]
                blocked = torch.ones(K + 1, K + 1, dtype=torch.bool).triu(1)
                scores[:, :, T:] = scores[:, :, T:].masked_fill(blocked, float("-inf"))
            a = (scores.softmax(-1) @ v).transpose(0, 1).reshape(K + 1, H * hd)
            x = x + a @ w["self_attn.o_proj.weight"].T
            m = _rms(x, w["post_attention_layernorm.weight"], eps)
            gate, up = m @ w["mlp.gate_proj.weight"].T, m @ w["mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w["mlp.down_proj.weight"].T
        out.append(_rms(x, norm, eps)[1:] @ head.T)
    return torch.stack(out)


def _heads(t: torch.Tensor, count: int, hd: int, weight, eps: float, cos, sin) -> torch.Tensor:
    """(n, count·hd) projections -> (count, n, hd): the per-head RMSNorm, then RoPE at cos, sin (n, hd)."""
    t = _rms(t.view(t.shape[0], count, hd), weight, eps).transpose(0, 1)
    return _rotate(t, cos[None], sin[None])


def speculators_dflash_gate(out_dir: Path, recipe, target, drafter: nn.Module) -> GateResult:
    """The speculators layout as vLLM (and the speculators package) compute it, against the trained drafter."""
    notes: list[str] = []
    config = read_json(out_dir / "config.json")
    tensors = read_safetensors(out_dir / ENGINE_WEIGHTS)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    unknown = sorted(k for k in tensors if k not in expected and not k.startswith("layers."))
    if unknown:  # vLLM's loader refuses a name it has no parameter for
        raise ExportError(f"{out_dir / ENGINE_WEIGHTS}: {unknown[:5]}: vLLM's DFlash has no such parameter")
    inputs = gate_inputs(drafter, target.config.num_hidden_layers, target.config.vocab_size)
    consumer = consumer_logits(config, tensors, target, *inputs, notes)
    return GateResult(consumer, drafter_logits(drafter, *inputs), notes)
