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

from eval.eagle_proposer import EagleProposer
from eval.heads import TwoStageProjection
from eval.proposal import Proposer, own_projection
from eval.static_proposers import (
    MedusaProposer,
    ParallelProposer,
    static_tree,
)
from models.methods import Method
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
    tree, vocab = ev.tree, draft_vocab
    two_stage = vocab is not None and not isinstance(vocab, torch.Tensor)
    if two_stage:
        suffix = f", two-stage head r{vocab[0].head.a.shape[1]} c{vocab[0].head.candidates}"
    else:
        suffix = "" if vocab is None else f", draft vocab {len(vocab)}"
    if method.proposer == "eagle":  # trees: auto, dynamic, chain
        if not method.own_vocab and not drafter.drafts_on_own_features() and ev.tree_depth > 1:
            raise ValueError(
                f"eval.tree_depth: {ev.tree_depth} with an eagle2 drafter fusing feature layers "
                f"{drafter.cfg.feature_layers}: it is trained for the first draft step only, and its later steps would "
                "read its own output, which training never showed it; evaluate it with eval.tree_depth=1, or train "
                "method eagle3 (training-time test)"
            )
        if two_stage:
            (vocab,) = vocab  # an EAGLE drafter drafts through one head
        if method.own_vocab:  # its own head over its draft vocabulary (sorted ids), or the N most frequent of them
            vocab = own_projection(drafter, vocab, two_stage)
            suffix = f", own draft vocab {len(drafter.d2t)}{suffix}"
        suffix += "" if window is None else f", window {window}"
        if tree == "chain":
            proposer = EagleProposer(drafter, ev.tree_depth, 1, ev.tree_depth + 1, vocab, window)
            return proposer, f"chain d{ev.tree_depth}{suffix}"
        k, n = ev.tree_top_k, ev.tree_total_tokens
        proposer = EagleProposer(drafter, ev.tree_depth, k, n, vocab, window)
        if tree == "cost":  # the caller measures `proposer.costs` on the machine before decoding
            return proposer, f"cost-aware d{ev.tree_depth} k{k} n{n}{suffix}"
        return proposer, f"dynamic d{ev.tree_depth} k{k} n{n}{suffix}"
    if method.proposer == "parallel":  # P-EAGLE: auto, calibrated, chain and the named trees, up to K deep
        if two_stage:
            (vocab,) = vocab  # one head: its own
        vocab = own_projection(drafter, vocab, two_stage)
        suffix = f", own draft vocab {len(drafter.d2t)}{suffix}" + ("" if window is None else f", window {window}")
        static, desc = static_tree(ev, drafter.cfg.parallel_tokens, calibrate)
        return ParallelProposer(drafter, static, vocab, window, ev.tree_total_tokens), f"{desc}{suffix}"
    static, desc = static_tree(ev, drafter.cfg.num_heads, calibrate)  # Medusa heads
    return MedusaProposer(drafter, static, vocab, ev.tree_total_tokens), f"{desc}{suffix}"
