"""EAGLE-3 drafter (and the EAGLE-3.1 switches): fused low/mid/high target features, its own LM head over a
trained draft vocabulary, trained by training-time test.

    python -m train recipes/tiny/eagle3.yaml      # trains Eagle3Drafter from feature shards (layers 0, 1, 2, -1)

Training: `Eagle3Drafter(cfg, target)` then `drafter.set_draft_vocab(token_ids, init_head=True)` (the training
loop passes the data's most frequent loss tokens), then `drafter(batch)` returns the unrolled loss. Drafting:
the same `new_cache()` / `step(...)` interface as `methods.eagle2.model.EagleDrafter`; its logits cover the draft
vocabulary (`draft_ids` maps them to target ids).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from methods.eagle2.model import (
    MLP,
    Attention,
    DecoderLayer,
    DraftCache,
    RMSNorm,
    logit_positions,
    step_mask,
    windowed,
)
from methods.eagle3.config import Eagle3Config
from models.common import (
    DraftBatch,
    DrafterOutput,
    FrozenRef,
    TargetParts,
    num_loss_tokens,
    segment_ids,
    shifted_valid,
)
from models.lm_head import FACTORS_NAME, DraftHead, unbiased_weight
from models.losses import distribution_loss


class Eagle3Layer(nn.Module):
    """The drafter's decoder layer: attention over [input_layernorm(embedding); hidden_norm(feature)] (2d inputs),
    then a SwiGLU MLP; the residual stream is the feature (or its normed form with `norm_before_residual`)."""

    def __init__(self, config, norm_before_residual: bool):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = RMSNorm(d, eps)
        self.hidden_norm = RMSNorm(d, eps)
        self.self_attn = Attention(config, in_dim=2 * d)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(config)

    def forward(self, emb: torch.Tensor, g: torch.Tensor, rope, mask: torch.Tensor, cache: DraftCache | None):
        """emb, g (B, n, d) -> h (B, n, d)."""
        normed = self.hidden_norm(g)
        residual = normed if self.norm_before_residual else g
        h = residual + self.self_attn(torch.cat([self.input_layernorm(emb), normed], dim=-1), rope, mask, cache, 0)
        return h + self.mlp(self.post_attention_layernorm(h))

    def unrolled(
        self, emb: torch.Tensor, g: torch.Tensor, rope, past: list[KeyValue], seg: torch.Tensor, real: torch.Tensor
    ) -> tuple[torch.Tensor, KeyValue]:
        """One training-time-test step over a whole batch: emb, g (B, T, d), the keys and values of the earlier steps
        (`past`, step 0 first), the packed samples' ids and real-token flags (B, T) -> h (B, T, d) and this step's
        keys and values. Attention as in `ttt_attention`, in memory linear in T."""
        normed = self.hidden_norm(g)
        residual = normed if self.norm_before_residual else g
        out, kv = unrolled_attention(self.self_attn, torch.cat([self.input_layernorm(emb), normed], dim=-1), rope, past,
                                     seg, real)  # fmt: skip
        h = residual + out
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class Eagle3UpperLayer(DecoderLayer):
    """A decoder layer after the first (`drafter.num_layers` > 1): a plain pre-norm Llama layer over the stream of
    the layer before, the embedding not read again (vLLM's multi-layer EAGLE-3 drafter)."""

    def __init__(self, config):
        super().__init__(config, input_norm=True)

    def unrolled(
        self, h: torch.Tensor, rope, past: list[KeyValue], seg: torch.Tensor, real: torch.Tensor
    ) -> tuple[torch.Tensor, KeyValue]:
        """As `Eagle3Layer.unrolled`, over the layer before's output h (B, T, d)."""
        out, kv = unrolled_attention(self.self_attn, self.input_layernorm(h), rope, past, seg, real)
        h = h + out
        return h + self.mlp(self.post_attention_layernorm(h)), kv


KeyValue = tuple[torch.Tensor, torch.Tensor]


def unrolled_attention(
    attn: Attention, x: torch.Tensor, rope, past: list[KeyValue], seg: torch.Tensor, real: torch.Tensor
) -> tuple[torch.Tensor, KeyValue]:
    """One layer's attention in a training-time-test step: its input x (B, T, d_in) and the keys and values it made
    in the earlier steps (`past`, step 0 first) -> its output (B, T, d) and this step's keys and values."""
    q, k, v = attn.project(x, rope)
    steps = [*past, (k, v)]
    keys = [attn.repeat_kv(key) for key, _ in steps]  # (B, H, T, hd) each
    values = [attn.repeat_kv(value) for _, value in steps]
    return attn.output(ttt_attention(q, keys, values, seg, real)), (k, v)


TARGET_HEAD_ROWS = 2048
"""Loss positions whose target distribution is computed at once: (2048, V) float32 is 400 MB for SmolLM2."""
TTT_QUERY_CHUNK = 256
"""Queries per block of `ttt_attention`: its memory is O(chunk x T) per block, recomputed in the backward pass."""


def ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], seg: torch.Tensor, real: torch.Tensor
) -> torch.Tensor:
    """Attention of unrolled step j = len(keys) - 1: q (B, H, T, hd); keys / values of steps 0..j (B, H, T, hd) each;
    packed sample ids `seg` and real-token flags `real` (B, T). Query t attends to the step-0 keys of its own sample up
    to t (never to padding; t itself always, so that no row is empty) and to its own keys of steps 1..j.

    That is the dense (B, T, (j+1)·T) mask `[causal | own | ... | own]` that drafting with a cache uses, computed in
    blocks of TTT_QUERY_CHUNK queries over the keys up to the block's end, the own keys as one score each: with
    activation checkpointing per block, memory grows linearly with T instead of quadratically (4k-token rows)."""
    T = q.shape[2]
    blocks = []
    for start in range(0, T, TTT_QUERY_CHUNK):
        end = min(start + TTT_QUERY_CHUNK, T)
        args = (
            q[:, :, start:end],
            keys[0][:, :, :end],
            values[0][:, :, :end],
            torch.stack([k[:, :, start:end] for k in keys[1:]], dim=3) if len(keys) > 1 else None,
            torch.stack([v[:, :, start:end] for v in values[1:]], dim=3) if len(values) > 1 else None,
            seg[:, :end],
            real[:, :end],
            start,
        )
        if torch.is_grad_enabled() and q.requires_grad:
            blocks.append(torch.utils.checkpoint.checkpoint(_ttt_block, *args, use_reentrant=False))
        else:
            blocks.append(_ttt_block(*args))
    return torch.cat(blocks, dim=2)  # (B, H, T, hd)


def _ttt_block(q, k0, v0, own_k, own_v, seg, real, start: int) -> torch.Tensor:
    """Queries start..start+c (B, H, c, hd) over step-0 keys 0..end (B, H, end, hd) and their own keys of the later
    steps (B, H, c, j, hd) -> (B, H, c, hd)."""
    c, end = q.shape[2], k0.shape[2]
    scale = q.shape[-1] ** -0.5
    scores = (q @ k0.transpose(-1, -2)).float() * scale  # (B, H, c, end)
    qpos = torch.arange(start, start + c, device=q.device)
    kpos = torch.arange(end, device=q.device)
    allowed = (kpos[None, :] <= qpos[:, None]) & (seg[:, start : start + c, None] == seg[:, None, :])  # (B, c, end)
    allowed = (allowed & real[:, None, :]) | (kpos[None, :] == qpos[:, None])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if own_k is not None:
        own = (q[:, :, :, None] * own_k).sum(-1).float() * scale  # (B, H, c, j)
        scores = torch.cat([scores, own], dim=-1)
    probs = scores.softmax(-1).to(q.dtype)  # (B, H, c, end [+ j])
    out = probs[..., :end] @ v0  # (B, H, c, hd)
    if own_v is not None:
        out = out + (probs[..., end:, None] * own_v).sum(-2)
    return out


class Eagle3Drafter(nn.Module):
    """EAGLE-3 (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
    Training-Time Test") with the EAGLE-3.1 switches FC-Norm and post-norm (`norm_output`).

    Input at position t: g_t = fc(cat_i FCNorm_i(f_t^(i))) over the target's low / mid / high hidden states, and
    the embedding of the next token x_{t+1} (the target's frozen embedding). One decoder layer (or `num_layers`: the
    later ones plain Llama layers over the first's output), a final RMSNorm and the drafter's own LM head over K draft
    tokens give the distribution of x_{t+2}. The next draft step reads the last layer's output (before the final norm;
    after it with `norm_output`) in place of g.

    Training-time test: the drafter is unrolled `ttt_steps` times over every position of a batch. Step j at
    position t reads its own step-(j-1) output and the true token x_{t+j+1}, stands at position t+j and attends to
    the step-0 keys of t's prefix (the target's features) and to its own keys at t from steps 1..j, exactly what
    it sees when drafting j tokens ahead. Its loss is the soft cross-entropy against the target's next-token
    distribution at t+j+1, renormalised over the draft vocabulary (or another objective on the same two
    distributions, `drafter.loss`: models/losses.py), weighted step_decay**j and divided by the number of loss
    tokens. Positions whose target top-1 token is outside the draft vocabulary are left out of
    the loss (their distribution cannot be matched there); the `acc@1` metrics still count them as misses.
    """

    def __init__(self, cfg: Eagle3Config, target: TargetParts):
        super().__init__()
        config = target.config
        self.cfg = dataclasses.replace(cfg, feature_layers=cfg.resolved_layers(config.num_hidden_layers))
        self.stored_layers = list(target.stored_layers)
        d, eps, n_feat = config.hidden_size, config.rms_norm_eps, len(self.cfg.feature_layers)
        self.target_vocab_size = config.vocab_size
        self._embed_tokens = FrozenRef(target.embed_tokens)
        self._target_head = FrozenRef(target.lm_head)
        self.fc_norm = nn.ModuleList(RMSNorm(d, eps) for _ in range(n_feat)) if cfg.fc_norm else None
        self.fc = nn.Linear(n_feat * d, d, bias=False)
        self.midlayer = Eagle3Layer(config, cfg.norm_before_residual)
        # layers 1.. by their index (`layers.1.*`, ...: vLLM's names; the first is `midlayer.*` = vLLM's `layers.0.*`)
        self.layers = nn.ModuleDict({str(i): Eagle3UpperLayer(config) for i in range(1, cfg.num_layers)})
        self.norm = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab, bias=False)
        # target id of draft id i = i + d2t[i]; t2d[v]: target token v is in the draft vocabulary
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.rotary_emb = LlamaRotaryEmbedding(config)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._embed_tokens.module

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def draft_ids(self) -> torch.Tensor:
        """(K,) target token id of each draft token."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: torch.Tensor, init_head: bool) -> None:
        """Draft on these K target tokens (any order; kept sorted by id). `init_head`: start the LM head from the
        target's rows for them (a fresh run; a resumed or exported one loads its trained head instead)."""
        K = self.cfg.draft_vocab
        if len(token_ids) != K or len(torch.unique(token_ids)) != K:
            raise ValueError(
                f"drafter.draft_vocab: {K} distinct tokens needed, got {len(torch.unique(token_ids))} (the training "
                f"data has only that many distinct loss tokens: lower drafter.draft_vocab)"
            )
        ids = token_ids.to(self.d2t.device, torch.int64).sort().values
        self.d2t.copy_(ids - torch.arange(K, device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True
        if init_head:
            head = self._target_head.module.weight
            self.lm_head.weight.copy_(head[ids.to(head.device)].to(self.lm_head.weight))

    # ---------------------------------------------------------------------------------------
    # Shared path

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (B, T, n_feat, d) in `cfg.feature_layers` order -> g (B, T, d)."""
        if self.fc_norm is not None:
            features = torch.stack([norm(features[:, :, i]) for i, norm in enumerate(self.fc_norm)], dim=2)
        return self.fc(features.flatten(2))

    def _predict(self, g, next_ids, position_ids, mask, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """g (B, n, d), next tokens (B, n), positions (B, n), mask (B, n, S+n) -> (h, norm(h)), (B, n, d) each."""
        emb = self.embed_tokens(next_ids).to(g.dtype)
        rope = self.rotary_emb(g, position_ids)
        h = self.midlayer(emb, g, rope, mask, cache)
        for i, layer in enumerate(self.layers.values(), start=1):
            h = layer(h, rope, mask, cache, i)
        return h, self.norm(h)

    def draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """(..., d) after the final norm -> (..., K) float32 logits over the draft vocabulary."""
        return self.lm_head(normed).float()

    # ---------------------------------------------------------------------------------------
    # Training

    def target_distribution(
        self, batch: DraftBatch, last: torch.Tensor, at: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """At the N loss positions `at` (B, T) with last hidden states `last` (N, d): the target's top-1 ids (N,), its
        distribution renormalised over the draft vocabulary (N, K) and its probability mass there (N,). From the
        whole head; or, when the batch carries the target's stored top-1 and logsumexp (`data.target_stats`), from
        the K draft rows only: the same numbers, up to the order of floating-point sums."""
        head, top1, probs, masses = self._target_head.module, [], [], []
        stored = "target_lse" in batch
        if stored:
            target_top1, lse = batch["target_top1"][at], batch["target_lse"][at]  # (N,) each
            if bool((target_top1 < 0).any()):
                raise ValueError("the batch's stored target statistics miss a loss position (data.target_stats)")
            rows_head = head.weight[self.draft_ids.to(head.weight.device)]  # (K, d)
        # (n, d) rows at a time: long packed rows keep (N, V) off memory
        for n, rows in enumerate(last.split(TARGET_HEAD_ROWS)):
            if stored:
                draft = F.linear(rows.to(rows_head.device, rows_head.dtype), rows_head).float().to(last.device)
                full_lse = lse[n * TARGET_HEAD_ROWS : n * TARGET_HEAD_ROWS + len(rows)]
            else:
                full = head(rows.to(head.weight.dtype)).float().to(last.device)  # (n, V)
                top1.append(full.argmax(-1))
                draft, full_lse = full[:, self.draft_ids], full.logsumexp(-1)  # (n, K), (n,)
            probs.append(draft.softmax(-1))
            masses.append((draft.logsumexp(-1) - full_lse).exp())  # the target's mass on the K tokens
        if not stored:
            target_top1 = torch.cat(top1) if top1 else last.new_zeros(0, dtype=torch.long)  # (N,)
        target_p = torch.cat(probs) if probs else last.new_zeros(0, len(self.d2t))  # (N, K)
        target_mass = torch.cat(masses) if masses else last.new_zeros(0)  # (N,)
        return target_top1, target_p, target_mass

    def unroll(self, batch: DraftBatch) -> list[torch.Tensor]:
        """Training-time test over a (packed, padded) batch: the final-norm outputs of each unrolled step,
        `ttt_steps` tensors (B, T, d); entry j at position t predicts token t+j+2."""
        hidden = batch["hidden"].to(self.compute_dtype)  # (B, T, n_stored, d)
        features = hidden[:, :, [self.stored_layers.index(layer) for layer in self.cfg.feature_layers]]
        if self.training and self.cfg.input_noise > 0:
            features = features + (torch.rand_like(features) * 2 - 1) * self.cfg.input_noise
        ids, positions = batch["input_ids"], batch["position_ids"]
        seg, real = segment_ids(positions), batch["attention_mask"].bool()  # (B, T) each
        past: list[list[KeyValue]] = [[] for _ in range(self.cfg.num_layers)]  # per layer, per step
        fed = self.fuse_features(features)  # (B, T, d)
        outputs = []
        # Always `ttt_steps` steps, even when a batch is too short for the later ones to have any target: every
        # process then runs the layer as often and reports the same metrics (collectives and ZeRO-3 gathers match).
        for j in range(self.cfg.ttt_steps):
            emb, g = self.unrolled_inputs(j, ids, fed)
            # step j stands at t + j and attends to t's prefix (step 0) and to t's own steps 1..j
            rope = self.rotary_emb(g, positions + j)
            h, kv = self.midlayer.unrolled(emb, g, rope, past[0], seg, real)
            past[0].append(kv)
            for i, layer in enumerate(self.layers.values(), start=1):
                h, kv = layer.unrolled(h, rope, past[i], seg, real)
                past[i].append(kv)
            normed = self.norm(h)
            outputs.append(normed)
            fed = normed if self.cfg.norm_output else h
        return outputs

    def unrolled_inputs(self, j: int, ids: torch.Tensor, fed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unrolled step j's inputs at every position t, (B, T, d) each: the embedding of the true token x_{t+j+1}
        (the last id past T) and `fed`, the fused target features at step 0 and the step before's output after."""
        B, T = ids.shape
        ahead = torch.arange(T, device=ids.device)
        next_ids = ids.gather(1, (ahead + j + 1).clamp(max=T - 1).expand(B, T))  # x_{t+j+1}
        return self.embed_tokens(next_ids).to(fed.dtype), fed

    def forward(self, batch: DraftBatch) -> DrafterOutput:
        last = batch["hidden"][:, :, self.stored_layers.index(-1)]  # (B, T, d)
        B, T = batch["input_ids"].shape
        # The target's distribution at every loss position, over the draft vocabulary (N rows), computed once.
        at = batch["loss_mask"] > 0  # (B, T)
        row = torch.full((B, T), -1, dtype=torch.long, device=last.device)
        row[at] = torch.arange(int(at.sum()), device=last.device)
        with torch.no_grad():
            target_top1, target_p, target_mass = self.target_distribution(batch, last[at], at)
            in_vocab = self.t2d[target_top1]  # (N,)
        n_loss = num_loss_tokens(batch)
        cfg = self.cfg
        k = min(cfg.topk_metric, cfg.draft_vocab)
        out: dict[str, torch.Tensor] = {}
        loss = last.new_zeros((), dtype=torch.float32)
        for j, normed in enumerate(self.unroll(batch)):
            rows = torch.full_like(row, -1)
            if j + 1 < T:
                rows[:, : T - j - 1] = row[:, j + 1 :]  # target row of position t+j+1
            valid = shifted_valid(batch, j + 1) & (rows >= 0)  # (B, T)
            r = rows[valid]  # (M,)
            logits = self.draft_logits(normed[valid])  # (M, K)
            keep = in_vocab[r]
            kept = r[keep]
            per_position, alpha = distribution_loss(
                cfg.loss, logits[keep], target_p[kept], target_mass[kept], cfg.loss_topk, cfg.loss_topk_weight,
                cfg.loss_eta,
            )  # fmt: skip
            step_loss = per_position.sum() / n_loss
            loss = loss + cfg.step_decay**j * step_loss
            with torch.no_grad():
                hit = self.draft_ids[logits.topk(k, dim=-1).indices] == target_top1[r][:, None]  # (M, k)
                n_valid = max(len(r), 1)
                name = "" if j == 0 else f"step{j}/"
                out[f"{name}acc@1"] = hit[:, 0].sum() / n_valid
                out[f"{name}alpha"] = alpha.sum() / max(len(kept), 1)
                if j == 0:
                    out[f"acc@{k}"] = hit.any(-1).sum() / n_valid
                    out["in_vocab"] = keep.sum() / n_valid
                out[f"{name}loss_{'ce' if cfg.loss == 'kl' else cfg.loss}"] = step_loss.detach()
        out["loss"] = loss
        return out

    # ---------------------------------------------------------------------------------------
    # Drafting with a KV cache (evaluation)

    def new_cache(self) -> DraftCache:
        return DraftCache([None] * self.cfg.num_layers, [None] * self.cfg.num_layers)

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
        """As `EagleDrafter.step`: logits (B, n or 1, K) over the draft vocabulary (or `project`'s), hidden_out
        (B, n, d), the input of the next step (`from_target=False`). Target `inputs` are (B, n, n_feat·d) in
        `cfg.feature_layers` order (or (B, n, n_feat, d))."""
        B, n = input_ids.shape
        inputs = inputs.to(self.compute_dtype)
        d = self.fc.out_features
        g = self.fuse_features(inputs.reshape(B, n, len(self.cfg.feature_layers), d)) if from_target else inputs
        mask = windowed(step_mask(tree_mask, B, n, cache.length, g.device), position_ids, cache.length, window)
        h, normed = self._predict(g, input_ids, position_ids, mask, cache)
        out = logit_positions(normed, last_only, logits_at)
        logits = self.draft_logits(out) if project is None else project(out)
        return logits, (normed if self.cfg.norm_output else h)

    # ---------------------------------------------------------------------------------------
    # What the training loop and exports need

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Trained tensors and the draft vocabulary (`d2t`, `t2d`); the target's embedding is never saved here."""
        out = {name: p.detach() for name, p in self.named_parameters() if p.requires_grad}
        return {**out, "d2t": self.d2t, "t2d": self.t2d}

    def is_head_param(self, name: str) -> bool:
        """Its own LM head (started from the target's rows) gets `train.head_lr_mult` times the learning rate."""
        return name.startswith("lm_head.")

    def draft_heads(self) -> list[DraftHead]:
        """Its own head over the draft vocabulary, for the two-stage head: fitted to what the head reads, the final-norm
        outputs of every unrolled step (`unroll`, without input noise) where that step's loss is taken."""

        @torch.no_grad()
        def inputs(sample: dict) -> torch.Tensor:
            device, T = self.fc.weight.device, len(sample["input_ids"])
            batch = {
                "input_ids": sample["input_ids"][None].to(device),
                "loss_mask": sample["loss_mask"][None].to(device),
                "attention_mask": torch.ones(1, T, dtype=torch.long, device=device),
                "position_ids": torch.arange(T, device=device)[None],
                "hidden": sample["hidden"][None].to(device),
            }
            training = self.training
            self.eval()
            try:
                steps = self.unroll(batch)
            finally:
                self.train(training)
            loss = batch["loss_mask"][0] > 0  # step j at t predicts token t+j+2, which the target predicts at t+j+1
            return torch.cat([normed[0][: -j - 1][loss[j + 1 :]] for j, normed in enumerate(steps)]).float().cpu()

        return [DraftHead(FACTORS_NAME, unbiased_weight(self.lm_head, "lm_head"), self.draft_ids, inputs)]
