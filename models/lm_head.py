"""Two-stage efficient LM head: the factors of its low-rank screen, fitted to what each draft head reads.

    counts = loss_token_counts(FeatureDataset("runs/features"), vocab_size=W.shape[0])  # (V,), data.shards
    moment = hidden_moment(h_train)  # (d, d) E[h·hᵀ] of training hidden states: fit the logits, not W
    factors = factorize(W, rank=64, weights=token_weights(counts), hidden_moment=moment)  # W ≈ a (V, r) @ b (r, d)
    factors.save("runs/lm_head")  # factors.safetensors; LowRankHead.load("runs/lm_head") reads it back
    samples = fit_samples(features, drafter.stored_layers)  # the first MOMENT_SAMPLES samples of feature shards
    save_factors(export_dir, drafter, samples, counts, rank=64)  # every draft head's, in <export>/lm_head/

Each draft step ends in a projection onto the vocabulary (V·d multiply-adds per token: 49,152 x 576 on
SmolLM2-135M), which dominates drafting. Stage 1 scores the whole vocabulary through a rank-r factorization
W ≈ A·B, s = (h·Bᵀ)·Aᵀ, at (V + d)·r per token, and keeps the `candidates` best ids; stage 2 gathers those rows
of the full W and computes their exact logits (C·d). A drafter only needs the top few tokens, so the screen
only has to rank them among its candidates, not get their logits right. The head that runs both stages
(`TwoStageHead`, its stage 1 in torch, the Triton kernel or its twin) is evaluation's: `eval.heads`.

The factors are a truncated SVD of D·W, D = diag(frequency weight of each token), with the scaling undone
afterwards (A = D⁻¹·U_r·S_r, B = V_rᵀ): the SVD minimises the weighted error Σ_v w_v²·|W_v - (AB)_v|², so the
tokens a drafter actually emits (frequent loss tokens) are approximated best. The weights only shape the
factors; the logits are never multiplied by them. `benchmarks/lm_head.py` measures recall and time on SmolLM2.

A drafter lists the vocabulary projections it drafts through in `draft_heads()` (`DraftHead`): an EAGLE-2 drafter
the target's lm_head, an EAGLE-3 drafter its own head over the draft vocabulary, Medusa one per head. Each gets
factors (`compute_factors`) frequency-aware (token weights from the training data's loss-token counts) and fitted
to the second moment of what that projection reads at the loss positions of some training samples, so that the
screen ranks the tokens the drafter actually proposes. `python -m export` stores them with the native export
(`save_factors`); evaluation reads them, or fits them at start-up. Torch only: this module imports neither data nor
eval (feature shards are handed in).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from models.common import share_safetensors

FACTORS_NAME = "factors"
"""File stem of a drafter's one head's factors (`factors.safetensors`); Medusa head k's are `factors-head{k}`."""
FACTORS_DIR = "lm_head"
"""Where a native export keeps its draft heads' factors: `<export>/lm_head/<head name>.safetensors`."""
MOMENT_SAMPLES = 256
"""Samples whose loss positions estimate E[h·hᵀ] (a few tens of thousands of positions: enough for d <= 1024)."""


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


def compute_factors(head: DraftHead, samples: Iterable[dict], counts: torch.Tensor, rank: int) -> LowRankHead:
    """Rank-`rank` factors of `head.weight` weighted by the loss-token `counts` (V,) of its rows' tokens and fitted to
    the second moment of `head.inputs` over `samples`. Fitted on the CPU in float32 (the SVD of a V x d matrix); the
    two-stage head moves them to the head's device. A ValueError naming the head when the samples have no loss
    positions."""
    if head.token_ids is not None:
        counts = counts[head.token_ids.cpu()]
    hidden = torch.cat([head.inputs(sample) for sample in samples])  # (N, d)
    if len(hidden) == 0:
        raise ValueError(f"the two-stage head {head.name}: the fitting samples have no loss positions")
    weight = head.weight.detach().to("cpu", torch.float32)
    return factorize(weight, rank, weights=token_weights(counts), hidden_moment=hidden_moment(hidden))


def fit_samples(features, stored_layers: Sequence[int], indices: Sequence[int] | None = None) -> list[dict]:
    """The fitting samples of feature shards (a `data.shards.FeatureDataset`): the first `MOMENT_SAMPLES` samples (of
    `indices`, default all), loss masks as bool. The shards must hold the drafter's `stored_layers`, in its order: a
    ValueError naming the shards otherwise."""
    if list(features.layers) != list(stored_layers):
        raise ValueError(
            f"{features.directory}: stores layers {features.layers}, the drafter reads {stored_layers}: the "
            "two-stage head's factors are fitted on the drafter's own inputs"
        )
    chosen = list(range(len(features)) if indices is None else indices)[:MOMENT_SAMPLES]
    return [{**s, "loss_mask": s["loss_mask"] > 0} for s in (features[i] for i in chosen)]


def save_factors(
    out: str | Path, drafter: torch.nn.Module, samples: Sequence[dict], counts: torch.Tensor, rank: int
) -> None:
    """Every draft head's factors into `out/lm_head/`, fitted on `samples` (`fit_samples`) with the loss-token
    counts over the target vocabulary `counts` (V,)."""
    for head in drafter.draft_heads():
        compute_factors(head, samples, counts, rank).save(Path(out) / FACTORS_DIR, head.name)
