"""Two-stage efficient LM head: a frequency-aware low-rank screen of the vocabulary, then exact logits.

    counts = loss_token_counts(FeatureDataset("runs/features"), vocab_size=W.shape[0])  # (V,)
    moment = hidden_moment(h_train)  # (d, d) E[h·hᵀ] of training hidden states: fit the logits, not W
    factors = factorize(W, rank=64, weights=token_weights(counts), hidden_moment=moment)  # W ≈ a (V, r) @ b (r, d)
    factors.save("runs/lm_head")  # factors.safetensors; LowRankHead.load("runs/lm_head") reads it back
    head = TwoStageHead(W, factors, candidates=256)
    ids, logits = head(h)  # h (N, d) -> candidate ids (N, C), their exact logits h·W[c]ᵀ (N, C)
    values, tokens = head.topk(h, k=4)  # (N, 4) each: the top-4 of the exact logits among the candidates
    head = TwoStageHead(W, factors, candidates=256, kernels="triton", block_v=256, k_local=16)  # fused stage 1

Each draft step ends in a projection onto the vocabulary (V·d multiply-adds per token: 49,152 x 576 on
SmolLM2-135M), which dominates drafting. Stage 1 scores the whole vocabulary through a rank-r factorization
W ≈ A·B, s = (h·Bᵀ)·Aᵀ, at (V + d)·r per token, and keeps the `candidates` best ids; stage 2 gathers those rows
of the full W and computes their exact logits (C·d). A drafter only needs the top few tokens, so the screen
only has to rank them among its candidates, not get their logits right.

The factors are a truncated SVD of D·W, D = diag(frequency weight of each token), with the scaling undone
afterwards (A = D⁻¹·U_r·S_r, B = V_rᵀ): the SVD minimises the weighted error Σ_v w_v²·|W_v - (AB)_v|², so the
tokens a drafter actually emits (frequent loss tokens) are approximated best. The weights only shape the
factors; the logits are never multiplied by them. `benchmarks/lm_head.py` measures recall and time on SmolLM2.

Stage 1 by default writes all V scores and takes their top C (`kernels="torch"`). With `kernels="triton"` (or its
twin, "reference") it runs `eval.kernels.lowrank.lowrank_topk` instead: A's rows are shuffled once by a fixed
permutation, each tile of `block_v` shuffled rows keeps its `k_local` best scores (the V scores are never written),
and the candidates are the best C of those survivors. That equals the plain top C when `k_local >= block_v`; otherwise
a tile holding more than `k_local` of a row's top C loses the rest (`benchmarks/lowrank_topk.py` measures the recall).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from data.shards import loss_token_counts  # noqa: F401  (re-exported: the counts `token_weights` takes)
from models.common import share_safetensors

FACTORS_NAME = "factors"
"""File stem of a drafter's one head's factors (`factors.safetensors`); Medusa head k's are `factors-head{k}`."""


@dataclass
class DraftHead:
    """One vocabulary projection a drafter drafts through, as the two-stage head needs to know it. Each drafter's
    `draft_heads()` lists its own (EAGLE: one; Medusa: one per head)."""

    name: str
    """File stem of its factors (`<name>.safetensors` in an export's `lm_head/`)."""
    weight: torch.Tensor
    """(R, d) its rows: the whole vocabulary, or a draft vocabulary (`token_ids`)."""
    token_ids: torch.Tensor | None
    """(R,) the target token of each row; None: row r scores token r."""
    inputs: Callable[[dict], torch.Tensor]
    """A sample {"input_ids" (T,), "hidden" (T, S, d) at the drafter's stored layers, "loss_mask" (T,)} -> (N, d)
    float32 on the CPU: what the projection reads where its loss is taken (its factors are fitted to them)."""


def unbiased_weight(projection: torch.nn.Linear, where: str) -> torch.Tensor:
    """A vocabulary projection's weight for a `DraftHead`; the two-stage head scores h·W[c]ᵀ, so a bias is refused."""
    if projection.bias is not None:
        raise ValueError(f"{where}: the two-stage head needs a vocabulary projection without a bias")
    return projection.weight


def token_weights(counts: torch.Tensor) -> torch.Tensor:
    """Row weights for `factorize` from token counts: sqrt(count + 1), (V,) float32. The square root because the
    SVD weighs squared errors, so w² = count + 1 weighs each token's error by how often it occurs; the +1 keeps
    unseen tokens in the fit (a zero weight would leave their rows arbitrary)."""
    return (counts.to(torch.float64) + 1).sqrt().to(torch.float32)


@dataclass
class LowRankHead:
    """Rank-r factors of an LM head: W (V, d) ≈ a (V, r) @ b (r, d)."""

    a: torch.Tensor  # (V, r)
    b: torch.Tensor  # (r, d)

    @property
    def rank(self) -> int:
        return self.b.shape[0]

    def save(self, directory: str | Path, name: str = FACTORS_NAME) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{name}.safetensors"
        save_file({"a": self.a.contiguous(), "b": self.b.contiguous()}, str(path))
        share_safetensors(path)
        return path

    @classmethod
    def load(cls, directory: str | Path, name: str = FACTORS_NAME) -> LowRankHead:
        """The factors saved by `save`; a ValueError naming the file when it is unreadable or lacks `a` / `b`."""
        path = Path(directory) / f"{name}.safetensors"
        try:
            with safe_open(str(path), framework="pt") as f:
                missing = sorted({"a", "b"} - set(f.keys()))
                if missing:
                    raise ValueError(f"{path}: no tensor {missing[0]!r} (low-rank factors hold `a` and `b`)")
                return cls(a=f.get_tensor("a"), b=f.get_tensor("b"))
        except (OSError, SafetensorError) as exc:
            raise ValueError(f"{path}: not readable low-rank factors ({exc})") from None


def factorize(
    weight: torch.Tensor, rank: int, weights: torch.Tensor | None = None, hidden_moment: torch.Tensor | None = None
) -> LowRankHead:
    """Frequency-aware truncated SVD of an LM head `weight` (V, d): factors of rank `rank` (1..min(V, d)) that
    minimise Σ_v weights_v²·|W_v - (AB)_v|². `weights` (V,) positive, None = uniform (the plain truncated SVD).

    `hidden_moment` (d, d) = E[h·hᵀ] over the hidden states the head reads (`hidden_moment(h)`) makes the fit
    data-aware: the factors then minimise Σ_v weights_v²·E_h[(h·W_v - h·(AB)_v)²], the error of the *logits*
    rather than of the weights. With L Lᵀ = E[h·hᵀ]: SVD of D·W·L, and B = V_rᵀ·L⁻¹. Final-norm hidden states
    are far from isotropic (a few channels carry most of the energy), so this matters a lot: on SmolLM2 it
    raises the candidates' top-1 recall at rank 64 from 0.86 to 0.97 (`benchmarks/lm_head.py`).
    Computed in float32 (bf16 heads are upcast); the factors are float32."""
    if weight.dim() != 2:
        raise ValueError(f"weight: want a (V, d) matrix, got shape {tuple(weight.shape)}")
    vocab, hidden = weight.shape
    if not 1 <= rank <= min(vocab, hidden):
        raise ValueError(f"rank={rank}: want 1 <= rank <= min(V, d) = {min(vocab, hidden)}")
    w = weight.detach().to(torch.float32)
    if weights is None:
        scale = torch.ones(vocab, dtype=torch.float32, device=w.device)
    else:
        if weights.shape != (vocab,):
            raise ValueError(f"weights: want shape ({vocab},), got {tuple(weights.shape)}")
        if not bool((weights > 0).all()):
            raise ValueError("weights: every token weight must be positive (a zero row cannot be unscaled)")
        scale = weights.detach().to(w.device, torch.float32)
    scaled = scale[:, None] * w  # (V, d)
    if hidden_moment is not None:
        if hidden_moment.shape != (hidden, hidden):
            raise ValueError(f"hidden_moment: want shape ({hidden}, {hidden}), got {tuple(hidden_moment.shape)}")
        # a relative jitter keeps the Cholesky factor invertible when some channel is (nearly) always zero
        m = hidden_moment.detach().to(w.device, torch.float64)
        m = m + 1e-6 * m.diagonal().mean() * torch.eye(hidden, dtype=torch.float64, device=w.device)
        chol = torch.linalg.cholesky(m).to(torch.float32)  # (d, d) lower, L Lᵀ = E[h·hᵀ]
        scaled = scaled @ chol
    u, s, vh = torch.linalg.svd(scaled, full_matrices=False)  # (V, k), (k,), (k, d); k = min(V, d)
    a = u[:, :rank] * s[:rank] / scale[:, None]  # (V, r): singular values folded into A, row scaling undone
    b = vh[:rank]  # (r, d)
    if hidden_moment is not None:
        b = torch.linalg.solve_triangular(chol.T, b.T, upper=True).T  # B = V_rᵀ·L⁻¹: Lᵀ·Bᵀ = V_r
    return LowRankHead(a=a.contiguous(), b=b.contiguous())


def hidden_moment(hidden: torch.Tensor) -> torch.Tensor:
    """E[h·hᵀ] (d, d) float32 of hidden states (..., d), for `factorize(hidden_moment=...)`. The second moment, not
    the covariance: logits are linear in h without centring, so the mean belongs in the fit."""
    h = hidden.reshape(-1, hidden.shape[-1]).to(torch.float64)  # (N, d)
    return (h.T @ h / len(h)).to(torch.float32)


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
        block_v: int = 256,
        k_local: int = 16,
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
