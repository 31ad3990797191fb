"""DFlash drafter: block diffusion drafting, `block_size - 1` tokens in one forward.

    python -m train recipes/tiny/dflash.yaml      # trains DFlashDrafter from feature shards

Training: `DFlashDrafter(cfg, target)(batch)` samples anchors among the assistant tokens, builds one block per anchor
(the anchor's token, then mask slots) and returns the position-weighted cross-entropy of the slots against the
tokens that follow the anchor. Drafting (`methods.dflash.proposer.DFlashProposer`): `context_kv` turns the target
features of newly verified positions into every layer's keys and values (kept per row), then `draft_block` runs one
block after the last verified token; slot k's logits are depth k's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from methods.dflash.config import DFlashConfig
from methods.eagle2.model import MLP, RMSNorm, _rotate_half
from models.common import DraftBatch, DrafterOutput, FrozenRef, TargetParts, num_loss_tokens, segment_ids

CE_CHUNK = 4096
"""Slots whose logits over the whole vocabulary are computed at a time; past one chunk each is recomputed in the
backward instead of kept (4096 x a 49k vocabulary: 800 MB of float32 logits)."""

KV = tuple[torch.Tensor, torch.Tensor]


class SharedRef:
    """Another layer's module, held without registering it (its weights are trained and saved once, where they are
    registered: layer 0's key norm)."""

    def __init__(self, module: nn.Module):
        self.module = module


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, n, hd) rotated by cos, sin (B, n, hd)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class DFlashAttention(nn.Module):
    """Qwen3-shaped attention (per-head RMSNorm on queries and keys, then RoPE) whose keys and values are the
    context's (the fused target features, projected by this layer's own k / v projections, no input norm) followed by
    the block's."""

    def __init__(self, config, shared_k_norm: RMSNorm | None):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = config.head_dim or d // self.num_heads
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.shared_k_norm = None if shared_k_norm is None else SharedRef(shared_k_norm)
        if shared_k_norm is None:
            self.k_norm = RMSNorm(self.head_dim, eps)

    def key_norm(self, k: torch.Tensor) -> torch.Tensor:
        return (self.k_norm if self.shared_k_norm is None else self.shared_k_norm.module)(k)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """x (B, n, d) -> k, v (B, Hkv, n, hd): the key norm and RoPE on k."""
        B, n, _ = x.shape
        k = self.key_norm(self.k_proj(x).view(B, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos, sin, context: KV, mask: torch.Tensor) -> torch.Tensor:
        """x (B, n, d) the normed block, context (k, v) (B, Hkv, S, hd), mask (B, n, S + n) bool -> (B, n, d)."""
        B, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, n, self.num_heads, self.head_dim)).transpose(1, 2)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(rope(q, cos, sin), k, v, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(B, n, -1))


class DFlashLayer(nn.Module):
    """Pre-norm decoder layer: attention over [context; block], then the SwiGLU MLP, each with a residual."""

    def __init__(self, config, shared_k_norm: RMSNorm | None):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = DFlashAttention(config, shared_k_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config)

    def forward(self, h: torch.Tensor, cos, sin, context: KV, mask: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """DFlash (Chen et al., 2026, "DFlash: Block Diffusion for Flash Speculative Decoding").

    The target's hidden states at `feature_layers` are concatenated and fused: c_t = hidden_norm(fc(h_t)). A block
    anchored at a verified position p holds the token x_p and `block_size - 1` mask tokens at positions p .. p+K
    (K = block_size - 1), embedded with the target's frozen embedding. Every layer attends from the block to the
    context c_0 .. c_{p-1} (through its own k / v projections, with its key norm and RoPE at the context positions)
    and to the whole block (bidirectionally). The final norm and the target's lm_head turn slot k into the
    distribution of the token at position p + k: one forward drafts K tokens.

    Training draws up to `max_anchors` anchors per sequence among its assistant tokens; each block sees only its
    own sample's context before its anchor and itself, never another block. Slot k's cross-entropy against the token
    at anchor + k is weighted exp(-(k - 1) / decay_gamma); per sequence the sum is scaled by (valid anchors / drawn
    anchors), an unbiased estimate of the sum over every anchor, and divided by the batch's loss tokens.
    """

    def __init__(self, cfg: DFlashConfig, target: TargetParts):
        super().__init__()
        self.cfg = cfg
        config = target.config
        self.stored_layers = list(target.stored_layers)
        self.feature_layers = cfg.resolved_layers(config.num_hidden_layers)
        missing = [i for i in self.feature_layers if i not in self.stored_layers]
        if missing:
            raise ValueError(f"drafter.feature_layers: {missing} not among the stored layers {self.stored_layers}")
        self.feature_index = [self.stored_layers.index(i) for i in self.feature_layers]
        d, eps = config.hidden_size, config.rms_norm_eps
        self._embed_tokens = FrozenRef(target.embed_tokens)
        self._lm_head = FrozenRef(target.lm_head)
        self.fc = nn.Linear(len(self.feature_layers) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, eps)
        first = DFlashLayer(config, None)
        shared = first.self_attn.k_norm if cfg.tie_k_norm else None
        self.layers = nn.ModuleList([first, *(DFlashLayer(config, shared) for _ in range(cfg.num_layers - 1))])
        self.norm = RMSNorm(d, eps)
        # imported here: recipe validation imports the config, and should not wait for transformers
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary_emb = LlamaRotaryEmbedding(config)  # the target's rope_theta and scaling

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._embed_tokens.module

    @property
    def lm_head(self) -> nn.Linear:
        return self._lm_head.module

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ---------------------------------------------------------------------------------------------
    # The pieces training and drafting share

    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target hidden states (B, T, n_stored, d) at the stored layers -> fused context c (B, T, d)."""
        features = hidden[:, :, self.feature_index].to(self.compute_dtype)
        return self.hidden_norm(self.fc(features.flatten(2)))

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Context c (B, S, d) at positions (B, S) -> every layer's keys and values (B, Hkv, S, hd)."""
        cos, sin = self.rotary_emb(c, positions)
        return [layer.self_attn.keys_values(c, cos, sin) for layer in self.layers]

    def run_block(self, ids: torch.Tensor, positions: torch.Tensor, context: list[KV], mask: torch.Tensor):
        """Block tokens (B, n) at positions (B, n), every layer's context keys and values, mask (B, n, S + n) ->
        final-norm outputs (B, n, d)."""
        h = self.embed_tokens(ids).to(self.compute_dtype)
        cos, sin = self.rotary_emb(h, positions)
        for layer, kv in zip(self.layers, context):
            h = layer(h, cos, sin, kv, mask)
        return self.norm(h)

    def draft_block(self, root: torch.Tensor, position: int, context: list[KV]) -> torch.Tensor:
        """One row's block after its verified prefix: root (1,) the last verified token at `position`, context keys
        and values of positions 0 .. position - 1 -> final-norm outputs of slots 1 .. K (1, K, d)."""
        K = self.cfg.block_size - 1
        ids = torch.full((1, K + 1), self.cfg.mask_token_id, dtype=torch.long, device=root.device)
        ids[0, 0] = root[0]
        positions = position + torch.arange(K + 1, device=root.device)[None]
        S = context[0][0].shape[2]
        mask = torch.ones(1, K + 1, S + K + 1, dtype=torch.bool, device=root.device)  # all the context, the block
        return self.run_block(ids, positions, context, mask)[:, 1:]

    # ---------------------------------------------------------------------------------------------
    # Training

    def anchors(self, batch: DraftBatch, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(anchors (B, A), valid (B, A) bool, scale (B,)): per row up to `limit` (default `max_anchors`) positions
        whose token is an assistant token followed by one of the same sample, drawn uniformly (evenly spaced when not
        training), in order; scale = valid anchors / drawn ones."""
        limit = limit or self.cfg.max_anchors
        loss = batch["loss_mask"] > 0
        seg = segment_ids(batch["position_ids"])
        ok = loss[:, :-1] & loss[:, 1:] & (seg[:, :-1] == seg[:, 1:]) & (batch["attention_mask"][:, :-1] > 0)
        picked, scale = [], []
        for row in ok:
            idx = row.nonzero().flatten()
            n = len(idx)
            if n > limit:
                if self.training:
                    idx = idx[torch.randperm(n, device=idx.device)[:limit]].sort().values
                else:
                    idx = idx[torch.linspace(0, n - 1, limit, device=idx.device).round().long()]
            picked.append(idx)
            scale.append(n / max(len(idx), 1))
        A = max(1, max(len(p) for p in picked))
        device = loss.device
        anchors = torch.zeros(len(picked), A, dtype=torch.long, device=device)
        valid = torch.zeros(len(picked), A, dtype=torch.bool, device=device)
        for b, idx in enumerate(picked):
            anchors[b, : len(idx)], valid[b, : len(idx)] = idx, True
        return anchors, valid, torch.tensor(scale, device=device)

    def blocks(self, batch: DraftBatch, anchors: torch.Tensor, valid: torch.Tensor):
        """One block per anchor, teacher-forced on the target's features -> (final-norm outputs (B, A, Bk, d),
        labels (B, A, Bk), label mask (B, A, Bk) bool; slot 0 never labelled)."""
        ids, pos = batch["input_ids"], batch["position_ids"]
        B, T = ids.shape
        A, Bk, device = anchors.shape[1], self.cfg.block_size, ids.device
        c = self.context(batch["hidden"])  # (B, T, d)
        context = self.context_kv(c, pos)
        offs = torch.arange(Bk, device=device)
        block_ids = torch.full((B, A, Bk), self.cfg.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, :, 0] = ids.gather(1, anchors)
        block_pos = pos.gather(1, anchors)[:, :, None] + offs  # (B, A, Bk)
        seg = segment_ids(pos)
        anchor_seg = seg.gather(1, anchors)  # (B, A)
        key = torch.arange(T, device=device)
        # the context before the anchor, of its own sample; every slot of its own block, no other block
        sees = (key[None, None] < anchors[:, :, None]) & (seg[:, None] == anchor_seg[:, :, None])
        sees &= batch["attention_mask"][:, None].bool()
        own = torch.eye(A, dtype=torch.bool, device=device).repeat_interleave(Bk, 0).repeat_interleave(Bk, 1)
        mask = torch.cat([sees.repeat_interleave(Bk, 1), own[None].expand(B, -1, -1)], dim=-1)
        normed = self.run_block(block_ids.flatten(1), block_pos.flatten(1), context, mask).view(B, A, Bk, -1)
        at = (anchors[:, :, None] + offs).clamp(max=T - 1)  # (B, A, Bk)
        labels = ids.gather(1, at.flatten(1)).view(B, A, Bk)
        labelled = batch["loss_mask"].gather(1, at.flatten(1)).view(B, A, Bk) > 0
        same = seg.gather(1, at.flatten(1)).view(B, A, Bk) == anchor_seg[..., None]
        labelled &= (anchors[:, :, None] + offs < T) & same
        labelled &= valid[:, :, None] & (offs > 0)
        return normed, labels, labelled

    def slot_weights(self, device) -> torch.Tensor:
        """(Bk,) the loss weight of each slot: 0 for the anchor's, exp(-(k - 1) / decay_gamma) for slot k >= 1."""
        k = torch.arange(self.cfg.block_size, device=device, dtype=torch.float32)
        return torch.where(k > 0, torch.exp(-(k - 1) / self.cfg.decay_gamma), torch.zeros_like(k))

    def forward(self, batch: DraftBatch) -> DrafterOutput:
        anchors, valid, scale = self.anchors(batch)
        normed, labels, labelled = self.blocks(batch, anchors, valid)
        Bk = self.cfg.block_size
        weight = self.slot_weights(normed.device)[None, None].expand_as(labelled) * scale[:, None, None]
        rows = labelled.nonzero(as_tuple=True)
        h, y, w = normed[rows], labels[rows], weight[rows]  # (N, d), (N,), (N,)
        slot = rows[2]
        total = normed.new_zeros((), dtype=torch.float32)
        hits = torch.zeros(Bk, device=normed.device)
        chunked = len(y) > CE_CHUNK  # one chunk keeps its logits for the backward; several recompute theirs
        for i in range(0, len(y), CE_CHUNK):
            part = slice(i, i + CE_CHUNK)
            if chunked:
                loss, hit = checkpoint(self._chunk_ce, h[part], y[part], w[part], use_reentrant=False)
            else:
                loss, hit = self._chunk_ce(h[part], y[part], w[part])
            total = total + loss
            hits.index_add_(0, slot[part], hit)
        counts = torch.bincount(slot, minlength=Bk).clamp(min=1)
        out = {"loss": total / num_loss_tokens(batch)}
        for k in range(1, min(Bk, 5)):  # the first slots' greedy accuracy, teacher-forced
            out[f"acc@1/slot{k}"] = hits[k] / counts[k]
        return out

    def _chunk_ce(self, h: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm_head(h.to(self.lm_head.weight.dtype)).float()  # (n, V)
        ce = F.cross_entropy(logits, y, reduction="none")
        return (ce * w).sum(), (logits.argmax(-1) == y).float().detach()

    # ---------------------------------------------------------------------------------------------
    # Export contract

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Its trained tensors (a tied key norm once, as layer 0's); never the target's embedding or lm_head."""
        return {name: p.detach() for name, p in self.named_parameters() if p.requires_grad}

    def is_head_param(self, name: str) -> bool:
        """No head of its own: the target's lm_head drafts."""
        return False
