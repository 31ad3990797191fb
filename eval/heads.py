"""The two-stage draft head (`eval.head: two_stage`) for every drafter: its factors, from the export or the data.

    save_factors(export_dir, drafter, features, rank, counts)  # train.export, with the native export
    projections, source = two_stage_projections(recipe, drafter_dir, drafter, V, fit_data)  # eval: one per draft head

A drafter lists the vocabulary projections it drafts through in `draft_heads()` (`models.lm_head.DraftHead`): an
EAGLE-2 drafter the target's lm_head, an EAGLE-3 drafter its own head over the draft vocabulary, Medusa one per
head. Each gets factors (`models.lm_head.factorize`) at rank `eval.head_rank`, frequency-aware (token weights from
the training data's loss-token counts) and fitted to the second moment of what that projection reads at the loss
positions of some training samples, so that the screen ranks the tokens the drafter actually proposes.

`python -m train.export` stores them with the native export (`lm_head/<head>.safetensors`) when the recipe asks for
the two-stage head and the run has feature shards. Evaluation reads them, or computes them at start-up (with a log
line) from the feature shards, or, for a drafter that adapts the target (Medusa-2) or a run without shards, from the
verifying target's hidden states over the calibration samples (`eval.run.fit_data`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from data.shards import FeatureDataset, loss_token_counts
from eval import EvalError
from eval.proposers import TwoStageProjection
from models.lm_head import DraftHead, LowRankHead, TwoStageHead, factorize, hidden_moment, token_weights

FACTORS_DIR = "lm_head"
MOMENT_SAMPLES = 256
"""Samples whose loss positions estimate E[h·hᵀ] (a few tens of thousands of positions: enough for d <= 1024)."""

FitData = tuple[list[dict], torch.Tensor, str]
"""(samples {"input_ids", "hidden" at the drafter's stored layers, "loss_mask"}, loss-token counts (V,), where from)."""


def compute_factors(head: DraftHead, samples: Iterable[dict], counts: torch.Tensor, rank: int) -> LowRankHead:
    """Rank-`rank` factors of `head.weight` weighted by the loss-token `counts` (V,) of its rows' tokens and fitted to
    the second moment of `head.inputs` over `samples`. Fitted on the CPU in float32 (the SVD of a V x d matrix); the
    two-stage head moves them to the head's device."""
    if head.token_ids is not None:
        counts = counts[head.token_ids.cpu()]
    hidden = torch.cat([head.inputs(sample) for sample in samples])  # (N, d)
    if len(hidden) == 0:
        raise EvalError(f"the two-stage head {head.name}: the fitting samples have no loss positions")
    weight = head.weight.detach().to("cpu", torch.float32)
    return factorize(weight, rank, weights=token_weights(counts), hidden_moment=hidden_moment(hidden))


def shard_fit_data(
    features: FeatureDataset,
    drafter: torch.nn.Module,
    vocab_size: int,
    indices: Sequence[int] | None = None,
    counts: torch.Tensor | None = None,
) -> FitData:
    """Fitting data from feature shards: the first `MOMENT_SAMPLES` samples (of `indices`, default all) and all the
    shards' loss-token counts (`counts` when the caller has them). The shards must hold the drafter's stored layers,
    in its order."""
    if list(features.layers) != list(drafter.stored_layers):
        raise EvalError(
            f"{features.directory}: stores layers {features.layers}, the drafter reads {drafter.stored_layers}: the "
            "two-stage head's factors are fitted on the drafter's own inputs"
        )
    if counts is None:
        counts = loss_token_counts(features, vocab_size=vocab_size)
    chosen = list(range(len(features)) if indices is None else indices)[:MOMENT_SAMPLES]
    samples = [{**s, "loss_mask": s["loss_mask"] > 0} for s in (features[i] for i in chosen)]
    return samples, counts, f"{features.directory}"


def save_factors(
    out: str | Path, drafter: torch.nn.Module, features: FeatureDataset, rank: int, counts: torch.Tensor
) -> None:
    """Every draft head's factors into `out/lm_head/`, fitted on the feature shards, whose loss-token counts over the
    target vocabulary are `counts` (V,)."""
    samples, counts, _ = shard_fit_data(features, drafter, len(counts), counts=counts)
    for head in drafter.draft_heads():
        compute_factors(head, samples, counts, rank).save(Path(out) / FACTORS_DIR, head.name)


def two_stage_projections(
    recipe, drafter_dir: str, drafter: torch.nn.Module, vocab_size: int, fit_data: Callable[[], FitData]
) -> tuple[list[TwoStageProjection], str]:
    """One two-stage projection per draft head of `drafter`, over a target vocabulary of `vocab_size`, and where their
    factors came from: the export's `lm_head/` when it holds every head's, else computed from `fit_data()`."""
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
        factors = [compute_factors(head, samples, counts, ev.head_rank) for head in heads]
        source = f"{where} (computed at start-up)"
    projections = [
        TwoStageProjection(TwoStageHead(head.weight, f, candidates=ev.head_candidates), vocab_size, head.token_ids)
        for head, f in zip(heads, factors)
    ]
    return projections, source
