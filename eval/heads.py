"""The two-stage draft head for evaluation (`eval.head: two_stage`): its factors, from the export or the data.

    projection = two_stage_projection(recipe, drafter_dir, drafter, target)   # -> eval.proposers.TwoStageProjection

Factors (`models.lm_head.factorize`) of the head the drafter projects through (an EAGLE-2 drafter: the target's
lm_head) at rank `eval.head_rank`, frequency-aware (token weights from the loss-token counts of the feature shards)
and fitted to the second moment of the stored last hidden states at loss positions (what the head reads), so that the
screen ranks the tokens the drafter actually proposes. `python -m train.export` stores them with the native export
(`lm_head/factors.safetensors`) when the recipe asks for the two-stage head; an export without them gets them
computed here from `data.features_dir`, with a log line.
"""

from __future__ import annotations

from pathlib import Path

import torch

from data.shards import FeatureDataset, loss_token_counts
from eval import EvalError
from eval.proposers import TwoStageProjection
from models.lm_head import LowRankHead, TwoStageHead, factorize, hidden_moment, token_weights

FACTORS_DIR = "lm_head"
MOMENT_SAMPLES = 256
"""Samples whose loss positions estimate E[h·hᵀ] (a few tens of thousands of positions: enough for d <= 1024)."""


def compute_factors(weight: torch.Tensor, features: FeatureDataset, rank: int) -> LowRankHead:
    """Rank-`rank` factors of `weight` (V, d) weighted by the shards' loss-token counts and fitted to the stored last
    hidden states' second moment."""
    if -1 not in features.layers:
        raise EvalError(f"{features.directory}: the two-stage head's fit reads the last hidden state (-1), not stored")
    counts = loss_token_counts(features, vocab_size=weight.shape[0])
    slot = features.layers.index(-1)
    rows = [features[i] for i in range(min(len(features), MOMENT_SAMPLES))]
    hidden = torch.cat([r["hidden"][:, slot][r["loss_mask"] > 0].to(torch.float32) for r in rows])
    return factorize(weight, rank, weights=token_weights(counts), hidden_moment=hidden_moment(hidden))


def two_stage_projection(recipe, drafter_dir: str, weight: torch.Tensor) -> tuple[TwoStageProjection, str]:
    """The proposer's projection through `weight` (the head the drafter reads), and where its factors came from."""
    ev = recipe.eval
    stored = Path(drafter_dir) / FACTORS_DIR
    if (stored / "factors.safetensors").is_file():
        factors, source = LowRankHead.load(stored), f"{stored}"
        if factors.rank != ev.head_rank:
            raise EvalError(
                f"{stored}: factors of rank {factors.rank}, eval.head_rank is {ev.head_rank} (re-export, or set it)"
            )
    else:
        directory = recipe.data.features_dir
        if not directory or not (Path(directory) / "manifest.json").is_file():
            raise EvalError(
                f"{recipe.source}: eval.head: two_stage needs factors: {drafter_dir} has no {FACTORS_DIR}/ and "
                f"data.features_dir ({directory}) holds no shards to compute them from"
            )
        print(f"eval: two-stage head factors computed from {directory} ({drafter_dir} has none)")
        features = FeatureDataset(directory, verify_checksums=recipe.data.verify_checksums)
        factors = compute_factors(weight, features, ev.head_rank)
        source = f"{directory} (computed at start-up)"
    head = TwoStageHead(weight, factors, candidates=ev.head_candidates)
    return TwoStageProjection(head, weight.shape[0]), source
