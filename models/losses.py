"""What a drafter with its own head over a draft vocabulary learns at each position: the objectives `drafter.loss`
chooses between (EAGLE-3 and P-EAGLE).

    loss, alpha = distribution_loss(cfg, logits, target_p, target_mass)   # per position, (M,) each

p is the target's next-token distribution renormalised over the K draft tokens, m the target's probability mass on
them (p·m is the target's own probability of each draft token) and q = softmax(logits) the drafter's. The drafter
proposes only draft tokens, so α = Σ_x min(p(x)·m, q(x)) is the probability that a token it samples is accepted by
speculative sampling at temperature 1 (Leviathan et al., 2023), whatever the objective; it is reported as `alpha`.

  * `kl`: KL(p ‖ q), as soft cross-entropy −Σ p log q (the same gradients): EAGLE-3's objective, the default.
  * `hass`: `kl` plus `loss_topk_weight` · (−Σ over the K' = `loss_topk` most likely tokens of p of p log q): the
    top-K distillation of HASS (Zhang et al., 2025, "Learning Harmonized Representations for Speculative Sampling"),
    which weighs the ranking of the tokens a tree drafts; HASS uses K' = 10 and weight 1.
  * `tv`: 1 − α, the total variation between the target and the drafter on what the drafter can propose.
  * `nla`: −log α, computed in log space; its gradient is TV's scaled by 1/α, which keeps it from vanishing where
    acceptance is low (LK losses, Samarin et al., 2026, "LK Losses: Direct Acceptance Rate Optimization for
    Speculative Decoding").
  * `lk_hybrid`: λ·KL(p ‖ q) + (1 − λ)·(1 − α) with λ = exp(−`loss_eta` · α) per position, α taken as a constant:
    KL where the drafter is still far off, total variation once it accepts often (LK losses; η = 3).
"""

from __future__ import annotations

from typing import get_args

import torch

from methods.limits import DraftLoss

LOSSES: tuple[str, ...] = get_args(DraftLoss)


def acceptance(target_p: torch.Tensor, target_mass: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """α = Σ min(p·m, q): target_p, q (M, K), target_mass (M,) -> (M,)."""
    return torch.minimum(target_p * target_mass[:, None], q).sum(-1)


def distribution_loss(
    kind: str,
    logits: torch.Tensor,
    target_p: torch.Tensor,
    target_mass: torch.Tensor,
    topk: int = 10,
    topk_weight: float = 1.0,
    eta: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position loss and acceptance α, (M,) each: draft logits (M, K) float32, the target's renormalised
    distribution over the draft vocabulary (M, K) and its mass there (M,)."""
    log_q = logits.log_softmax(-1)  # (M, K)
    q = log_q.exp()
    with torch.no_grad():
        alpha = acceptance(target_p, target_mass, q)
    if kind in ("kl", "hass"):
        loss = -(target_p * log_q).sum(-1)
        if kind == "hass":
            k = min(topk, target_p.shape[-1])
            top_p, top_i = target_p.topk(k, dim=-1)  # (M, k)
            loss = loss + topk_weight * -(top_p * log_q.gather(-1, top_i)).sum(-1)
        return loss, alpha
    if kind == "tv":
        return 1 - acceptance(target_p, target_mass, q), alpha
    if kind == "nla":
        log_pm = target_p.log() + target_mass.log()[:, None]  # log(p·m); -inf where p underflowed to 0
        return -torch.logsumexp(torch.minimum(log_pm, log_q), dim=-1), alpha
    if kind == "lk_hybrid":
        kl = (torch.xlogy(target_p, target_p) - target_p * log_q).sum(-1)
        lam = torch.exp(-eta * alpha)  # α is a constant here: the mix moves, not the gradient through it
        return lam * kl + (1 - lam) * (1 - acceptance(target_p, target_mass, q)), alpha
    raise ValueError(f"unknown drafter.loss {kind!r} (known: {', '.join(LOSSES)})")
