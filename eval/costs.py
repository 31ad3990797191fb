"""Start-up timing for cost-aware trees (`eval.tree: cost`): what a verifying forward costs per tree size, and what
one draft step costs, on this machine, for this target and drafter.

    costs = measure_costs(target.model, proposer, prompt_ids, max_size=ev.tree_total_tokens, batch_size=B)

Verify cost: the target's forward over n new tokens on top of a cached prefix (the prompt), best of `repeats`, for
n = 1, 2, 4, ... up to `max_size` (a causal forward stands in for the tree-masked one: the same matmuls). Draft cost:
one drafter step over `tree_top_k` positions on a cache of the prompt's length, through the proposer's projection
(full head, draft vocabulary or two-stage head); for static-tree drafters (Medusa heads, P-EAGLE), their one
drafting forward of a round over a few new positions. Points are made non-decreasing (a larger forward that measured
faster is noise). On a GPU the timings synchronise the device.
"""

from __future__ import annotations

import time

import torch

from eval.cost_trees import Costs
from eval.proposal import DecodeState
from eval.static_proposers import StaticTreeProposer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_of(fn, repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def measure_costs(model, proposer, prompt_ids: torch.Tensor, max_size: int, batch_size: int = 1, repeats: int = 3):
    """`Costs` for `proposer` (an EagleProposer) verified by `model`, from a prefix like `prompt_ids` (1, P)."""
    device = next(model.parameters()).device
    prefix = prompt_ids.to(device).expand(batch_size, -1)
    P = prefix.shape[1]
    cache = model(prefix, use_cache=True).past_key_values
    sizes = sorted({1, *[2**i for i in range(1, max_size.bit_length()) if 2**i <= max_size], max_size})
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    points = []
    for n in sizes:
        ids = torch.randint(0, vocab, (batch_size, n), generator=gen).to(device)
        pos = torch.arange(P, P + n, device=device).expand(batch_size, n)

        def verify(ids=ids, pos=pos, n=n) -> None:
            model(ids, position_ids=pos, past_key_values=cache, use_cache=True)
            cache.crop(-n)  # transformers 5: the number of tokens to remove

        verify()  # warm-up at this size
        points.append((n, _best_of(verify, repeats, device)))
    for i in range(1, len(points)):  # monotone: noise must not make a larger tree look cheaper
        points[i] = (points[i][0], max(points[i][1], points[i - 1][1]))

    if isinstance(proposer, StaticTreeProposer):  # Medusa heads, P-EAGLE: one forward drafts every depth
        features = len(proposer.feature_layers)
        new = torch.randn(1, min(P, 4), features, model.config.hidden_size, generator=gen).to(device)
        state = DecodeState(tokens=prefix[:1], new_hidden=new.to(next(model.parameters()).dtype))

        def draft_round() -> None:
            proposer.reset(batch_size)
            proposer.depth_topk([state] * batch_size)

        draft_round()
        cost = _best_of(draft_round, repeats, device)
        proposer.reset(batch_size)
        return Costs.from_points(points, draft_cost=cost)
    drafter = proposer.drafter
    d = drafter.fc.out_features  # the drafter's hidden size (EAGLE-2 and EAGLE-3 alike)
    n_feat = len(proposer.feature_layers)
    dtype = next(drafter.parameters()).dtype
    feats = torch.randn(batch_size, P, n_feat * d, generator=gen).to(device, dtype)
    k = proposer.top_k
    draft_cache = drafter.new_cache()
    ids_p = prefix.clone()
    drafter.step(feats, ids_p, torch.arange(P, device=device).expand(batch_size, P), draft_cache, last_only=True)
    hidden = torch.randn(batch_size, k, d, generator=gen).to(device, dtype)
    tokens = torch.randint(0, vocab, (batch_size, k), generator=gen).to(device)
    pos = torch.full((batch_size, k), P, device=device)
    mask = torch.ones(batch_size, k, P + k, dtype=torch.bool, device=device)

    def draft() -> None:
        drafter.step(hidden, tokens, pos, draft_cache, tree_mask=mask, from_target=False, project=proposer.vocab)
        draft_cache.crop(P)

    draft()
    return Costs.from_points(points, draft_cost=_best_of(draft, repeats, device))
