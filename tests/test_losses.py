"""models.losses: the objectives `drafter.loss` chooses for drafters with a draft vocabulary (EAGLE-3, P-EAGLE) against
their definitions, the acceptance rate against speculative sampling's, and every objective training a drafter."""

from __future__ import annotations

import pytest
import torch
from test_eagle3 import LAYERS, drafter_for
from tiny import make_batch, make_samples
from tiny import tiny_llama as tiny_target

from models.losses import LOSSES, acceptance, distribution_loss

torch.set_num_threads(1)


def distributions(M: int = 6, K: int = 9, V: int = 15, seed: int = 0):
    """Draft logits (M, K) and, from random target logits over V tokens of which the first K are the draft
    vocabulary: p renormalised over them, their mass m, and the full target distribution (M, V)."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(M, V, generator=g) * 2).softmax(-1)
    mass = full[:, :K].sum(-1)
    return torch.randn(M, K, generator=g, requires_grad=True), full[:, :K] / mass[:, None], mass, full


def test_alpha_is_one_minus_total_variation_over_the_whole_vocabulary():
    logits, p, m, full = distributions()
    q = logits.softmax(-1)
    q_full = torch.cat([q, torch.zeros(len(q), full.shape[1] - q.shape[1])], dim=1)  # it drafts only draft tokens
    tv = 0.5 * (full - q_full).abs().sum(-1)
    torch.testing.assert_close(acceptance(p, m, q), 1 - tv)


def test_alpha_is_the_acceptance_rate_of_speculative_sampling():
    """Draw x ~ q, accept with min(1, p(x)/q(x)): the empirical acceptance rate converges to α."""
    logits, p, m, full = distributions(M=1, seed=3)
    q = logits.softmax(-1).detach()
    g = torch.Generator().manual_seed(0)
    n = 200_000
    x = torch.multinomial(q[0], n, replacement=True, generator=g)
    accepted = torch.rand(n, generator=g) < (full[0, x] / q[0, x]).clamp(max=1)
    alpha = float(acceptance(p, m, q)[0])
    assert abs(float(accepted.float().mean()) - alpha) < 4 * (alpha * (1 - alpha) / n) ** 0.5


def test_each_objective_is_its_definition():
    logits, p, m, _ = distributions()
    log_q = logits.log_softmax(-1)
    q = log_q.exp()
    alpha = torch.minimum(p * m[:, None], q).sum(-1)
    kl, a = distribution_loss("kl", logits, p, m)
    torch.testing.assert_close(kl, -(p * log_q).sum(-1))
    torch.testing.assert_close(a, alpha)
    hass, _ = distribution_loss("hass", logits, p, m, topk=3, topk_weight=0.5)
    top = p.topk(3, dim=-1)
    torch.testing.assert_close(hass, kl - 0.5 * (top.values * log_q.gather(-1, top.indices)).sum(-1))
    everything, _ = distribution_loss("hass", logits, p, m, topk=100, topk_weight=1.0)
    torch.testing.assert_close(everything, 2 * kl)  # K' beyond the vocabulary: every token, the CE once more
    torch.testing.assert_close(distribution_loss("tv", logits, p, m)[0], 1 - alpha)
    torch.testing.assert_close(distribution_loss("nla", logits, p, m)[0], -alpha.log())
    true_kl = (p * (p.log() - log_q)).sum(-1)
    torch.testing.assert_close(distribution_loss("lk_hybrid", logits, p, m, eta=0.0)[0], true_kl)
    lam = torch.exp(-3 * alpha)
    torch.testing.assert_close(distribution_loss("lk_hybrid", logits, p, m)[0], lam * true_kl + (1 - lam) * (1 - alpha))
    with pytest.raises(ValueError, match="unknown drafter.loss 'ce'"):
        distribution_loss("ce", logits, p, m)


def test_nla_scales_the_total_variation_gradient_by_one_over_alpha():
    logits, p, m, _ = distributions()
    (g_tv,) = torch.autograd.grad(distribution_loss("tv", logits, p, m)[0].sum(), logits)
    (g_nla,) = torch.autograd.grad(distribution_loss("nla", logits, p, m)[0].sum(), logits)
    alpha = distribution_loss("kl", logits, p, m)[1]
    torch.testing.assert_close(g_nla, g_tv / alpha[:, None], atol=1e-6, rtol=1e-4)


def test_a_target_token_that_underflows_keeps_every_objective_finite():
    logits, p, m, _ = distributions()
    p = p.clone()
    p[:, 0] = 0.0
    p = p / p.sum(-1, keepdim=True)
    for kind in LOSSES:
        loss, _ = distribution_loss(kind, logits, p, m)
        (grad,) = torch.autograd.grad(loss.sum(), logits)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all(), kind


@pytest.fixture(scope="module")
def batch():
    model = tiny_target()
    return model, make_batch(model, make_samples([11, 8, 13]), LAYERS, rows=[[0], [1], [2]], width=13)


@pytest.mark.parametrize("kind", LOSSES)
def test_every_objective_trains_an_eagle3_drafter(batch, kind):
    """Each objective, the rest of the drafter unchanged, raises the acceptance rate α on the batch it trains on;
    `alpha` in the metrics is the hand-computed α of step 0 over the positions in the loss."""
    model, padded = batch
    drafter = drafter_for(model, vocab=200, ttt_steps=2, loss=kind).train()
    with torch.no_grad():
        out = drafter(padded)
        normed = drafter.unroll(padded)[0]
        alphas = []
        for b, n in enumerate([11, 8, 13]):
            for t in range(n - 1):
                full = model.lm_head(padded["hidden"][b, t + 1, 2]).float().softmax(-1)
                if padded["loss_mask"][b, t + 1] and drafter.t2d[full.argmax()]:
                    q = drafter.draft_logits(normed[b, t]).softmax(-1)
                    alphas.append(float(torch.minimum(full[drafter.draft_ids], q).sum()))
        assert float(out["alpha"]) == pytest.approx(sum(alphas) / len(alphas), rel=1e-5)
    before = float(out["alpha"])
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(40):
        opt.zero_grad()
        drafter(padded)["loss"].backward()
        opt.step()
    with torch.no_grad():
        after = float(drafter(padded)["alpha"])
    assert after > before + 0.1, (kind, before, after)
