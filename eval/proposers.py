"""Drafters as the speculative loop uses them: the `Proposer` contract, the EAGLE-2, Medusa and P-EAGLE proposers.

    proposer, desc = build_proposer(METHODS[method], drafter, recipe.eval, calibrate, draft_vocab)  # per `eval.tree`
    proposer.reset(batch_size)
    trees = proposer.propose([DecodeState(tokens=row_tokens, new_hidden=row_hidden), ...])  # one tree per row
    proposer.commit(paths)  # the accepted node indices of each row's tree, root first

`eval.decode` runs the loop: it calls `reset(B)`, then each round `propose` with the states of the rows still
decoding, `commit` with their accepted paths, and `keep_rows` when some rows finish. The contract is
`eval.proposal` (`DecodeState`, `Proposer`, `VocabProjection`: drafting restricted to a draft vocabulary); the
proposers, each drafting every row of a batch in the same forwards, are `eval.eagle_proposer.EagleProposer` and
`eval.static_proposers` (`MedusaProposer`, `ParallelProposer`: static trees, calibrated for P-EAGLE by
`parallel_rank_accuracy`). Here: which one a method's declared proposer kind and `eval.tree` make.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from eval.heads import TwoStageProjection
from eval.proposal import Proposer
from methods import Method, resolve
from schema.evaluation import EvalConfig

# --------------------------------------------------------------------------------------------
# Drafter + recipe -> proposer


def build_proposer(
    method: Method,
    drafter: torch.nn.Module,
    ev: EvalConfig,
    calibrate: Callable[[int], torch.Tensor],
    draft_vocab: torch.Tensor | Sequence[TwoStageProjection] | None = None,
    window: int | None = None,
) -> tuple[Proposer, str]:
    """The proposer `method` declares for `drafter` and `eval.tree`, with a short description of the tree.

    `eval.tree` is one of `method.trees` (the recipe schema checks it). `calibrate(top_k)` returns measured Medusa
    rank accuracies (only called for calibrated trees); `draft_vocab` restricts drafting to those token ids, or
    holds the two-stage projection of each of the drafter's draft heads (`eval.heads.two_stage_projections`);
    `window` limits an EAGLE drafter's attention to that many positions back (Medusa heads have no attention).
    """
    return resolve(method.proposer)(method, drafter, ev, calibrate, draft_vocab, window)
