"""EAGLE-2 drafter with the EAGLE-3.1 normalisations (FC-Norm, post-norm).

    python -m train recipes/tiny/eagle2.yaml      # trains EagleDrafter from feature shards

Training: `EagleDrafter(cfg, target)(batch)` returns the feature-regression + soft-CE loss.
Drafting (evaluation): `cache = drafter.new_cache()`, then `drafter.step(...)` with target features
for the verified prefix and with the drafter's own `hidden_out` for the positions it drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from methods.eagle2.config import EagleConfig
from models.common import (
    DraftBatch,
    DrafterOutput,
    FrozenRef,
    TargetParts,
    num_loss_tokens,
    packed_causal_mask,
    shifted_valid,
)
from models.lm_head import FACTORS_NAME, DraftHead, unbiased_weight

# ------------------------------------------------------------------------------------------------
# Llama building blocks (written here so the drafter does not depend on a modeling file's internals)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Multi-head attention with RoPE and grouped KV heads, shaped like the target's (HF parameter names)."""

    def __init__(self, config, in_dim: int | None = None):
        super().__init__()
        d = config.hidden_size
        d_in = in_dim or d  # EAGLE-3's layer attends over [embedding; feature]: 2d inputs
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or d // self.num_heads
        self.q_proj = nn.Linear(d_in, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, n, d_in) -> q (B, H, n, hd), k and v (B, Hkv, n, hd), RoPE applied to q and k."""
        B, n, _ = x.shape
        q = self.q_proj(x).view(B, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, n, hd)
        k = self.k_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, n, hd)
        v = self.v_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, n, hd)
        cos, sin = rope[0][:, None], rope[1][:, None]  # (B, 1, n, hd)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, S, hd) -> (B, H, S, hd). Explicit: SDPA's enable_gqa has no memory-efficient masked GPU kernel."""
        return t.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """(B, H, n, hd) attention output -> (B, n, d)."""
        B, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, n, self.num_heads * self.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: DraftCache | None,
        layer_idx: int,
    ) -> torch.Tensor:
        q, k, v = self.project(x, rope)
        if cache is not None:
            k, v = cache.update(layer_idx, k, v)  # (B, Hkv, S + n, hd)
        out = F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask[:, None])
        return self.output(out)  # (B, n, d)


class MLP(nn.Module):
    """SwiGLU feed-forward with the target's intermediate size."""

    def __init__(self, config):
        super().__init__()
        d, m = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, m, bias=False)
        self.up_proj = nn.Linear(d, m, bias=False)
        self.down_proj = nn.Linear(m, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Llama decoder layer; `input_norm=False` drops input_layernorm (EAGLE-1/2 layer 0)."""

    def __init__(self, config, input_norm: bool):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps) if input_norm else None
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor, rope, mask: torch.Tensor, cache: DraftCache | None, idx: int) -> torch.Tensor:
        x = h if self.input_layernorm is None else self.input_layernorm(h)
        h = h + self.self_attn(x, rope, mask, cache, idx)  # (B, n, d)
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, n, d)


def step_mask(tree_mask: torch.Tensor | None, B: int, n: int, S: int, device: torch.device) -> torch.Tensor:
    """A draft step's attention mask (B, n, S+n) over S cached and n new positions from its `tree_mask` argument:
    None = causal among the new positions; (B, n, n) = among the new positions, every cached one visible;
    (B, n, S+n) = as given."""
    if tree_mask is None:
        tree_mask = torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(B, n, n)
    if tree_mask.shape[-1] == n:
        seen = torch.ones(B, n, S, dtype=torch.bool, device=device)
        tree_mask = torch.cat([seen, tree_mask.to(device)], dim=-1)
    return tree_mask


def windowed(mask: torch.Tensor, position_ids: torch.Tensor, cached: int, window: int | None) -> torch.Tensor:
    """A draft step's mask (B, n, S+n) with every key `window` or more positions before its query masked out, so the
    drafter attends at most `window - 1` positions back, as far as it saw in training, however long the context. A
    cached key's position is its index (the cache holds each row's verified prefix, packed, then the current tree's
    steps, which all lie near the queries); a new key's is its `position_ids`. None: no limit."""
    if window is None:
        return mask
    B = position_ids.shape[0]
    cached_pos = torch.arange(cached, device=mask.device).expand(B, cached)
    keys = torch.cat([cached_pos, position_ids.to(mask.device)], dim=1)  # (B, S + n)
    far = keys[:, None, :] <= position_ids.to(mask.device)[:, :, None] - window  # (B, n, S + n)
    return mask & ~far


def logit_positions(out: torch.Tensor, last_only: bool, logits_at: torch.Tensor | None) -> torch.Tensor:
    """The new positions (B, n, d) a draft step computes logits for: all, the last (B, 1, d), or row b's
    `logits_at[b]` (B, 1, d)."""
    if logits_at is not None:
        return out[torch.arange(out.shape[0], device=out.device), logits_at.to(out.device)][:, None]
    return out[:, -1:] if last_only else out


@dataclass
class DraftCache:
    """Keys and values of the drafter's layers for the positions drafted so far, (B, Hkv, S, hd) each."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' k, v (B, Hkv, n, hd) to layer `layer`; return the full (B, Hkv, S+n, hd)."""
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (drop a rejected draft)."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[:, :, :length], v[:, :, :length]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows `rows` (B',) in that order (requests that finished leave the batch)."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[rows.to(k.device)], v[rows.to(v.device)]

    def select(self, keep: torch.Tensor) -> None:
        """Keep positions `keep`, in that order: (m,) for every row, or (B, m) per row (commit an accepted path)."""
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is None:
                continue
            if keep.dim() == 1:
                self.keys[i], self.values[i] = k[:, :, keep], v[:, :, keep]
            else:
                idx = keep[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])  # (B, Hkv, m, hd)
                self.keys[i], self.values[i] = k.gather(2, idx), v.gather(2, idx)


# ------------------------------------------------------------------------------------------------
# The drafter


class EagleDrafter(nn.Module):
    """EAGLE-2 (Li et al., 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees";
    drafter of "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty") with the
    EAGLE-3.1 normalisations FC-Norm and post-norm.

    EAGLE drafts at the feature level: at position t it reads the target's feature f_t and the
    embedding of the token that follows, e(x_{t+1}) (the target's frozen embedding), and predicts the
    next feature f̂_{t+1}; the target's frozen lm_head turns f̂_{t+1} into the distribution of
    x_{t+2}. Knowing the sampled token x_{t+1} resolves the feature's uncertainty. The input is
    g_t = FCNorm(f_t) (one feature layer) or `fuse(cat_i FCNorm_i(f_t^(i)))` (several layers,
    EAGLE-3-style), then `fc(cat(e(x_{t+1}), g_t))`, then Llama decoder layers (layer 0 without
    input_layernorm) and, with post-norm, an output RMSNorm whose output is f̂. Training regresses
    the target's last hidden state with per-token SmoothL1 (mean over d) plus w_ce times a soft
    cross-entropy against softmax(lm_head(f_{t+1})), summed over positions whose token t+1 is an
    assistant token of the same sample, divided by the number of loss tokens. When drafting, f̂
    replaces the target feature at the next step, so a chain or tree of tokens is drafted
    autoregressively with the drafter's own KV cache.
    """

    def __init__(self, cfg: EagleConfig, target: TargetParts):
        super().__init__()
        self.cfg = cfg
        self.stored_layers = list(target.stored_layers)
        config = target.config
        self.num_target_layers = config.num_hidden_layers
        d, eps, n_feat = config.hidden_size, config.rms_norm_eps, len(cfg.feature_layers)
        # Frozen target modules, borrowed by reference and not registered (not in state_dict, .to(), ZeRO).
        self._embed_tokens = FrozenRef(target.embed_tokens)
        self._lm_head = FrozenRef(target.lm_head)
        self.fc_norm = nn.ModuleList(RMSNorm(d, eps) for _ in range(n_feat)) if cfg.fc_norm else None
        self.fuse = nn.Linear(n_feat * d, d, bias=False) if n_feat > 1 else None
        self.fc = nn.Linear(2 * d, d, bias=cfg.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(config, input_norm=i > 0) for i in range(cfg.num_layers))
        self.norm = RMSNorm(d, eps) if cfg.post_norm else None
        # imported here: recipe validation imports this module for EagleConfig and should not wait for transformers
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary_emb = LlamaRotaryEmbedding(config)  # honours the target's rope_theta and rope scaling

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The target's frozen input embedding (borrowed, not a submodule of the drafter)."""
        return self._embed_tokens.module

    @property
    def lm_head(self) -> nn.Linear:
        """The target's frozen lm_head (borrowed, not a submodule of the drafter)."""
        return self._lm_head.module

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ---------------------------------------------------------------------------------------
    # Shared path: features + next tokens -> predicted next features

    def drafts_on_own_features(self) -> bool:
        """Whether draft steps past the first get an input of the kind training shows: the drafter reads only the
        last hidden state (`-1`, or its index L), so its own prediction f̂ of it goes through the same path. A drafter
        fusing several layers is trained on the first step only (its later steps would read f̂ directly)."""
        L = self.num_target_layers
        return [L if i == -1 else i for i in self.cfg.feature_layers] == [L]

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (B, T, n_feat, d) at `cfg.feature_layers` -> drafter input g (B, T, d)."""
        if self.fc_norm is not None:
            features = torch.stack([norm(features[:, :, i]) for i, norm in enumerate(self.fc_norm)], dim=2)
        if self.fuse is None:
            return features[:, :, 0]  # (B, T, d)
        return self.fuse(features.flatten(2))  # (B, T, d)

    def _predict(
        self,
        g: torch.Tensor,
        next_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        cache: DraftCache | None,
    ) -> torch.Tensor:
        """g (B, n, d), next tokens (B, n), positions (B, n), mask (B, n, S+n) bool -> f̂ (B, n, d)."""
        emb = self.embed_tokens(next_ids).to(g.dtype)  # (B, n, d)
        h = self.fc(torch.cat([emb, g], dim=-1))  # (B, n, d)
        rope = self.rotary_emb(h, position_ids)  # cos, sin: (B, n, hd)
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, mask, cache, i)  # (B, n, d)
        return h if self.norm is None else self.norm(h)

    def logits(self, f_hat: torch.Tensor) -> torch.Tensor:
        """Frozen target lm_head on predicted features (..., d) -> (..., V), float32, on f_hat's device (a `device_map`
        target's lm_head can sit on another GPU)."""
        return self.lm_head(f_hat.to(self.lm_head.weight.dtype)).float().to(f_hat.device)

    # ---------------------------------------------------------------------------------------
    # Training

    def predict_features(self, batch: DraftBatch) -> torch.Tensor:
        """Teacher-forced f̂ for every position of a (packed, padded) batch: (B, T, d); f̂[:, t] predicts f_{t+1}."""
        hidden = batch["hidden"].to(self.compute_dtype)  # (B, T, n_stored, d)
        slots = [self.stored_layers.index(layer) for layer in self.cfg.feature_layers]
        features = hidden[:, :, slots]  # (B, T, n_feat, d)
        if self.training and self.cfg.input_noise > 0:
            features = features + (torch.rand_like(features) * 2 - 1) * self.cfg.input_noise
        ids = batch["input_ids"]
        # x_{t+1}; the last column (and a packed sample's last token) sees an unrelated token, but
        # such positions are never a loss position and no other position of their sample attends to them.
        next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # (B, T)
        mask = packed_causal_mask(batch)  # (B, T, T)
        return self._predict(self.fuse_features(features), next_ids, batch["position_ids"], mask, None)

    def forward(self, batch: DraftBatch) -> DrafterOutput:
        f_hat = self.predict_features(batch)  # (B, T, d)
        last = batch["hidden"][:, :, self.stored_layers.index(-1)].to(self.compute_dtype)  # (B, T, d)
        valid = shifted_valid(batch, 1)[:, :-1]  # (B, T-1): x_{t+1} is a loss token of the same sample
        pred = f_hat[:, :-1][valid]  # (N, d)
        true = last[:, 1:][valid]  # (N, d): f_{t+1}
        with torch.no_grad():
            target_logits = self.logits(true)  # (N, V)
            target_p = target_logits.softmax(-1)
        draft_logits = self.logits(pred)  # (N, V)
        feat = F.smooth_l1_loss(pred.float(), true.float(), reduction="none").mean(-1)  # (N,)
        ce = -(target_p * draft_logits.log_softmax(-1)).sum(-1)  # (N,)
        n_loss = num_loss_tokens(batch)
        loss_feat, loss_ce = feat.sum() / n_loss, ce.sum() / n_loss
        out = {"loss": self.cfg.w_feat * loss_feat + self.cfg.w_ce * loss_ce}
        with torch.no_grad():
            n_valid = pred.shape[0] or 1
            k = min(self.cfg.topk_metric, draft_logits.shape[-1])
            hit = draft_logits.topk(k, dim=-1).indices == target_logits.argmax(-1, keepdim=True)  # (N, k)
            out["acc@1"] = hit[:, 0].sum() / n_valid
            out[f"acc@{k}"] = hit.any(-1).sum() / n_valid
            out["loss_feat"], out["loss_ce"] = loss_feat.detach(), loss_ce.detach()
        return out

    # ---------------------------------------------------------------------------------------
    # Drafting with a KV cache (evaluation)

    def new_cache(self) -> DraftCache:
        return DraftCache([None] * len(self.layers), [None] * len(self.layers))

    @torch.no_grad()
    def step(
        self,
        inputs: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache,
        tree_mask: torch.Tensor | None = None,
        from_target: bool = True,
        project: Callable[[torch.Tensor], torch.Tensor] | None = None,
        last_only: bool = False,
        logits_at: torch.Tensor | None = None,
        window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run n new positions on top of `cache` (which they extend); returns logits (B, n, V), hidden_out (B, n, d).

        New position i stands at `position_ids[:, i]` = p and reads `input_ids[:, i]` = x_{p+1} with
        - `from_target=True`: `inputs` = target features at p, (B, n, n_feat·d) concatenated in
          `cfg.feature_layers` order (or (B, n, n_feat, d));
        - `from_target=False`: `inputs` = the drafter's own `hidden_out` (B, n, d) for p, i.e. its
          prediction of f_p. With feature_layers [-1] it takes f's path through FC-Norm, exactly as
          target features do in training; with fused layers it replaces g (EAGLE-3 convention).
        Its logits predict x_{p+2}; `hidden_out` is f̂_{p+1}, the input of the next step.
        `tree_mask`: None = causal among the new positions; (B, n, n) bool = which new positions each
        new position sees (ancestors and itself), all cached positions visible; (B, n, S+n) bool = the
        full mask over cache and new positions (multi-round tree drafting, where earlier tree nodes
        are in the cache and must be hidden from other branches).
        `project`: f̂ (..., d) -> logits (..., K) instead of the full lm_head (a draft vocabulary);
        `last_only`: logits for the last new position only (B, 1, ·), as a catch-up step needs;
        `logits_at` (B,): logits for new position logits_at[b] of row b only (B, 1, ·), the same for a
        batch whose rows have different numbers of new positions (padded at the end).
        `window`: attend to cached positions fewer than this many positions back only (`windowed`).
        """
        B, n = input_ids.shape
        d = self.fc.in_features // 2
        inputs = inputs.to(self.compute_dtype)
        if from_target:
            g = self.fuse_features(inputs.reshape(B, n, len(self.cfg.feature_layers), d))
        elif self.drafts_on_own_features():
            g = self.fuse_features(inputs[:, :, None])
        else:
            g = inputs
        mask = windowed(step_mask(tree_mask, B, n, cache.length, g.device), position_ids, cache.length, window)
        f_hat = self._predict(g, input_ids, position_ids, mask, cache)  # (B, n, d)
        out = logit_positions(f_hat, last_only, logits_at)
        return (self.logits(out) if project is None else project(out)), f_hat

    # ---------------------------------------------------------------------------------------
    # What the training loop needs

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Trained tensors only; the frozen target embedding and lm_head are the target's, never saved here."""
        return {name: p.detach() for name, p in self.named_parameters() if p.requires_grad}

    def is_head_param(self, name: str) -> bool:
        """EAGLE has no Medusa-style heads: no parameter gets the head LR multiplier."""
        return False

    def draft_heads(self) -> list[DraftHead]:
        """The projection the draft steps end in (the target's lm_head), for the two-stage head: fitted to the
        target's last hidden states at loss positions, the features f̂ learns to predict."""
        slot = self.stored_layers.index(-1)

        def inputs(sample: dict) -> torch.Tensor:
            return sample["hidden"][:, slot][sample["loss_mask"] > 0].float().cpu()

        return [DraftHead(FACTORS_NAME, unbiased_weight(self.lm_head, "the target's lm_head"), None, inputs)]
