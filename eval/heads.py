"""The two-stage draft head at evaluation (`eval.head: two_stage`): the screen, the projection a draft step calls,
and where the factors come from.

    projections, source = two_stage_projections(recipe, drafter_dir, drafter, V, fit_data)  # one per draft head
    head = TwoStageHead(W, factors, candidates=256)  # factors: models.lm_head
    ids, logits = head(h)  # h (N, d) -> candidate ids (N, C), their exact logits h·W[c]ᵀ (N, C)
    values, tokens = head.topk(h, k=4)  # (N, 4) each: the top-4 of the exact logits among the candidates
    head = TwoStageHead(W, factors, candidates=256, kernels="triton", block_v=256, k_local=16)  # fused stage 1
    logits = TwoStageProjection(head, V)(h)  # (N, V): exact logits of the candidates, -inf elsewhere

Stage 1 of `TwoStageHead` by default writes all V scores and takes their top C (`kernels="torch"`). With
`kernels="triton"` (or its twin, "reference") it runs `eval.kernels.lowrank.lowrank_topk` instead: A's rows are
shuffled once by a fixed permutation, each tile of `block_v` shuffled rows keeps its `k_local` best scores (the V
scores are never written), and the candidates are the best C of those survivors. That equals the plain top C when
`k_local >= block_v`; otherwise a tile holding more than `k_local` of a row's top C loses the rest
(`benchmarks/lowrank_topk.py` measures the recall).

Evaluation screens with `eval.kernels`: the fused Triton kernel (`triton`, on a GPU or under the interpreter) or its
PyTorch twin (`reference`), in tiles of `BLOCK_V` rows keeping `K_LOCAL` each; a head too small for `head_candidates`
to survive such tiles gets smaller ones (`screen_block`, 16 rows at least: every row survives).

The factors (`models.lm_head`: one per draft head, fitted to what it reads) come with the export when `python -m
export.write` stored them (`lm_head/<head>.safetensors`: the recipe asks for the two-stage head and the run has
feature shards). Else evaluation computes them at start-up (with a log line) from the feature shards, or, for a drafter
that adapts the target (Medusa-2) or a run without shards, from the verifying target's hidden states over the
calibration samples (`eval.calibration.fit_data`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from data.shards import FeatureDataset
from data.vocab_counts import loss_token_counts
from eval import EvalError
from models.lm_head import FACTORS_DIR, DraftHead, LowRankHead, compute_factors, fit_samples

BLOCK_V, K_LOCAL = 256, 16
"""The tiled screen's default: tiles of this many shuffled rows keep this many candidates each."""

FitData = tuple[list[dict], torch.Tensor, str]
"""(samples {"input_ids", "hidden" at the drafter's stored layers, "loss_mask"}, loss-token counts (V,), where from)."""


class TwoStageHead:
    """Stage 1 ranks the vocabulary by (h·Bᵀ)·Aᵀ and keeps the top `candidates` ids; stage 2 computes their exact
    logits h·W[c]ᵀ. Computes in the dtype of `weight` (float32 recommended on CPU: bf16 matmuls are slow there).

    `kernels`: "torch" (stage 1 = the top `candidates` of all V scores), "triton" or "reference" (the tile-local screen
    `eval.kernels.lowrank.lowrank_topk` over A's rows shuffled by `perm` (V,) shuffled row -> token id; default a
    fixed random permutation, seed `seed`), with tiles of `block_v` rows keeping `k_local` each."""

    def __init__(
        self,
        weight: torch.Tensor,
        factors: LowRankHead,
        candidates: int,
        kernels: str = "torch",
        block_v: int = BLOCK_V,
        k_local: int = K_LOCAL,
        perm: torch.Tensor | None = None,
        seed: int = 0,
    ) -> None:
        vocab, hidden = weight.shape
        if factors.a.shape[0] != vocab or factors.b.shape[1] != hidden:
            raise ValueError(
                f"factors: a {tuple(factors.a.shape)}, b {tuple(factors.b.shape)} do not fit weight {(vocab, hidden)}"
            )
        if not 1 <= candidates <= vocab:
            raise ValueError(f"candidates={candidates}: want 1 <= candidates <= V = {vocab}")
        self.weight = weight.detach()  # (V, d)
        self.a = factors.a.detach().to(weight.device, weight.dtype).contiguous()  # (V, r)
        self.b = factors.b.detach().to(weight.device, weight.dtype).contiguous()  # (r, d)
        self.candidates = candidates
        if kernels not in ("torch", "triton", "reference"):
            raise ValueError(f"unknown kernels {kernels!r}; expected 'torch', 'triton' or 'reference'")
        self.kernels, self.block_v, self.k_local = kernels, block_v, k_local
        if kernels != "torch":
            from eval.kernels.lowrank import tile_survivors  # imports triton: only for the tiled screen

            if block_v < 16 or block_v & (block_v - 1) or k_local < 1:
                raise ValueError(f"block_v={block_v}, k_local={k_local}: want a power of two >= 16, and >= 1")
            if candidates > tile_survivors(vocab, block_v, k_local):
                raise ValueError(
                    f"candidates={candidates}: more than the {tile_survivors(vocab, block_v, k_local)} rows that "
                    f"survive tiles of block_v={block_v} keeping k_local={k_local}"
                )
            if perm is None:
                perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
            if perm.shape != (vocab,) or not torch.equal(perm.sort().values.cpu(), torch.arange(vocab)):
                raise ValueError(f"perm: want a permutation of range({vocab})")
            self.perm = perm.to(weight.device, torch.int64)  # (V,) shuffled row -> token id
            self.a_shuffled = self.a[self.perm].contiguous()  # (V, r)

    def flops_ratio(self) -> float:
        """Multiply-adds per token of stage 1 + stage 2 over the full head's V·d (top-k selection not counted)."""
        (vocab, hidden), rank = self.weight.shape, self.a.shape[1]
        return ((vocab + hidden) * rank + self.candidates * hidden) / (vocab * hidden)

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (..., d) -> (candidate ids (..., C) int64, in stage-1 order; their exact logits (..., C))."""
        lead = h.shape[:-1]
        x = h.reshape(-1, h.shape[-1]).to(self.weight.dtype)  # (N, d)
        if self.kernels == "torch":
            scores = (x @ self.b.T) @ self.a.T  # (N, V) approximate logits
            ids = scores.topk(self.candidates, dim=-1).indices  # (N, C)
        else:
            from eval.kernels.lowrank import lowrank_topk

            u = x @ self.b.T  # (N, r)
            args = (self.a_shuffled, self.perm, self.block_v, self.k_local, self.candidates)
            ids = lowrank_topk(u, *args, kernels=self.kernels)[1]  # (N, C), best approximate score first
        # index_select + multiply-sum: on CPU about 5x faster than `weight[ids]` followed by bmm (a batched
        # matrix-vector product takes a slow path), which made stage 2 cost more than stage 1
        rows = self.weight.index_select(0, ids.reshape(-1)).view(*ids.shape, -1)  # (N, C, d)
        logits = (rows * x[:, None, :]).sum(-1)  # (N, C) exact logits
        return ids.reshape(*lead, -1), logits.reshape(*lead, -1)

    def topk(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, token ids), each (..., k): the top-k exact logits among the candidates, best first."""
        if not 1 <= k <= self.candidates:
            raise ValueError(f"top_k={k}: want 1 <= top_k <= candidates = {self.candidates}")
        ids, logits = self(h)
        values, where = logits.topk(k, dim=-1)
        return values, ids.gather(-1, where)


class TwoStageProjection:
    """The two-stage head (`TwoStageHead`) as a draft step's projection: a low-rank screen of the head's rows keeps
    `head.candidates` of them per position and their exact logits are computed; the result is laid out over the target
    vocabulary (`vocab_size`), -inf off the candidates, so the proposer drafts only among them (verification still uses
    the target's full distribution: greedy output is unchanged, sampled output still follows the target).
    `row_tokens` (R,): the target token of each row of a draft-vocabulary head; None: row r is token r."""

    def __init__(self, head, vocab_size: int, row_tokens: torch.Tensor | None = None):
        self.head, self.vocab_size = head, vocab_size
        self.rows_to_tokens = None if row_tokens is None else row_tokens.to(head.weight.device)
        self.size = head.candidates  # tokens a position can draft among

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., V) float32 logits, -inf off each position's candidates, on h's device."""
        ids, logits = self.head(h.to(self.head.weight.device))
        if self.rows_to_tokens is not None:
            ids = self.rows_to_tokens[ids]
        out = torch.full((*ids.shape[:-1], self.vocab_size), float("-inf"), device=ids.device)
        return out.scatter_(-1, ids, logits.float()).to(h.device)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Positions in this projection's output -> token ids: the same (it is laid out over the vocabulary)."""
        return index

    def full_log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1)


def shard_fit_data(
    features: FeatureDataset,
    drafter: torch.nn.Module,
    vocab_size: int,
    indices: Sequence[int] | None = None,
    counts: torch.Tensor | None = None,
) -> FitData:
    """Fitting data from feature shards: the first `MOMENT_SAMPLES` samples (of `indices`, default all;
    `models.lm_head.fit_samples`) and all the shards' loss-token counts (`counts` when the caller has them). The shards
    must hold the drafter's stored layers, in its order."""
    try:
        samples = fit_samples(features, drafter.stored_layers, indices)
    except ValueError as exc:
        raise EvalError(str(exc)) from None
    if counts is None:
        counts = loss_token_counts(features, vocab_size=vocab_size)
    return samples, counts, f"{features.directory}"


def screen_block(rows: int, candidates: int) -> int:
    """The tile (`block_v`) of evaluation's screen over a head of `rows` rows keeping `candidates`: `BLOCK_V`, halved
    while fewer than `candidates` rows survive tiles keeping `K_LOCAL` each (at `K_LOCAL` rows every row does)."""
    from eval.kernels.lowrank import tile_survivors  # imports triton: only for the tiled screen

    block_v = BLOCK_V
    while block_v > K_LOCAL and tile_survivors(rows, block_v, K_LOCAL) < candidates:
        block_v //= 2
    return block_v


def two_stage_projections(
    recipe, drafter_dir: str, drafter: torch.nn.Module, vocab_size: int, fit_data: Callable[[], FitData]
) -> tuple[list[TwoStageProjection], str]:
    """One two-stage projection per draft head of `drafter`, over a target vocabulary of `vocab_size`, and where their
    factors came from: the export's `lm_head/` when it holds every head's, else computed from `fit_data()`. Their
    screens run on `eval.kernels` (the Triton kernel, or its twin)."""
    ev = recipe.eval
    heads: Sequence[DraftHead] = drafter.draft_heads()
    rows = min(len(head.weight) for head in heads)
    if ev.head_candidates > rows:
        raise EvalError(
            f"{recipe.source}: eval.head_candidates: {ev.head_candidates} is more than the {rows} tokens the drafter's "
            "head scores"
        )
    stored = Path(drafter_dir) / FACTORS_DIR
    if all((stored / f"{head.name}.safetensors").is_file() for head in heads):
        try:
            factors, source = [LowRankHead.load(stored, head.name) for head in heads], f"{stored}"
        except ValueError as exc:
            raise EvalError(f"{exc}: delete it to factorize the head again") from None
        for head, f in zip(heads, factors):
            if f.rank != ev.head_rank:
                raise EvalError(
                    f"{stored / head.name}.safetensors: factors of rank {f.rank}, eval.head_rank is {ev.head_rank} "
                    "(re-export, or set it)"
                )
    else:
        samples, counts, where = fit_data()
        print(f"eval: two-stage head factors computed from {where} ({drafter_dir} has none)")
        try:
            factors = [compute_factors(head, samples, counts, ev.head_rank) for head in heads]
        except ValueError as exc:
            raise EvalError(str(exc)) from None
        source = f"{where} (computed at start-up)"
    projections = []
    for head, f in zip(heads, factors):  # stage 1 through the Triton kernel, or its twin (`eval.kernels`)
        block_v = screen_block(len(head.weight), ev.head_candidates)
        screen = TwoStageHead(head.weight, f, ev.head_candidates, ev.kernels, block_v, K_LOCAL)
        projections.append(TwoStageProjection(screen, vocab_size, head.token_ids))
    return projections, source
