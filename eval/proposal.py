"""The contract between the speculative loop and a drafter: a row's `DecodeState`, the `Proposer` protocol, and the
projection onto a draft vocabulary (`VocabProjection`, `own_projection`). The proposers are `eval.eagle_proposer`
and `eval.static_proposers`; `eval.proposers.build_proposer` picks one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from eval.heads import TwoStageProjection
from eval.trees import Tree


@dataclass
class DecodeState:
    """What a proposer sees of one row (prompt) before drafting.

    `tokens[:, -1]` is the root: chosen by the target, not yet in its KV cache, so the target cache
    holds `prefix_len = L - 1` positions. `new_hidden` holds the target hidden states (at the
    proposer's `feature_layers`) of the positions cached since the previous round, i.e. positions
    `L-1-n .. L-2`, whose next tokens are `tokens[:, L-n:]`.
    """

    tokens: torch.Tensor  # (1, L) int64, prompt + generated
    new_hidden: torch.Tensor | None  # (1, n, S, d) or None when the proposer wants no features

    @property
    def prefix_len(self) -> int:
        return self.tokens.shape[1] - 1


RankFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], list[float]]
"""(row, tokens (n,), parents (n,) with -1 for the root, log path probabilities (n,) of the candidates drafted so
far) -> the acceptance estimates, best first, that the round's tree will choose from (`eval.lookup.merged_ranking`
adds a prompt-lookup continuation's)."""


class Proposer(Protocol):
    """A drafter as the decoding loop uses it (EAGLE-2, Medusa heads, check stubs), for a batch of rows.

    The loop calls `reset(B)`, then each round `propose` with the states of the rows still decoding, `commit` with
    their accepted paths, and `keep_rows` when some rows finish. Stub drafters written for one prompt at a time
    (`eval.checks.RowProposer`) run as a batch through `eval.checks.PerRow`.
    """

    feature_layers: list[int]
    """Target hidden-state indices (HF convention) the proposer reads from `DecodeState.new_hidden`."""
    window: int | None
    """The drafter attends to fewer than this many positions back; None: the whole context, or no attention."""

    def reset(self, batch_size: int) -> None:
        """Forget previous prompts: the next round drafts for `batch_size` new rows."""

    def propose(self, states: Sequence[DecodeState]) -> list[Tree]:
        """Draft one tree per row, rooted at `states[b].tokens[:, -1]`."""

    def propose_scored(
        self, states: Sequence[DecodeState], rank_fn: RankFn | None = None
    ) -> tuple[list[Tree], list[torch.Tensor]]:
        """`propose`, with each tree's node scores (N,): log path probabilities under the drafter, the root's 0
        (what `eval.lookup` ranks prompt-lookup candidates against). EAGLE and Medusa proposers have it.
        `rank_fn`: what a cost-aware drafter's early stop weighs deeper drafting against (`RankFn`); drafters
        without an early stop ignore it."""

    def commit(self, paths: Sequence[list[int]]) -> None:
        """Per row, the target accepted `paths[b]` (node indices of its last proposed tree, root first)."""

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows (indices among the current ones, in order) decode on; the others finished."""


class VocabProjection:
    """A draft vocabulary: a vocabulary projection restricted to `ids` (K,), its rows gathered once.

    Drafting then costs a (K × d) instead of a (V × d) matmul per step; tokens outside `ids` are never drafted.
    Verification still uses the target's full distribution, so the output is unchanged (greedy) or still
    follows the target (sampled); only acceptance can drop.
    """

    def __init__(self, projection: torch.nn.Linear, ids: torch.Tensor):
        self.ids = ids  # (K,)
        self.vocab_size = projection.weight.shape[0]
        rows = ids.to(projection.weight.device)  # the projection's device: a `device_map` lm_head may be on another GPU
        self.weight = projection.weight[rows].detach()  # (K, d)
        self.bias = None if projection.bias is None else projection.bias[rows].detach()

    @classmethod
    def trained(
        cls, head: torch.nn.Linear, ids: torch.Tensor, vocab_size: int, rows: torch.Tensor | None = None
    ) -> VocabProjection:
        """A drafter's own head over its draft vocabulary: row i scores target token `ids[i]` of `vocab_size`.
        `rows`: only these rows (a smaller draft vocabulary inside its own, `eval.draft_vocab`)."""
        if rows is not None:  # gathered as any draft vocabulary's rows are, then relabelled with their tokens
            out = cls(head, rows)
            out.ids = ids[rows.to(ids.device)]
        else:  # the whole head, not copied
            out = cls.__new__(cls)
            out.ids, out.weight = ids, head.weight.detach()
            out.bias = None if head.bias is None else head.bias.detach()
        out.vocab_size = vocab_size
        return out

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., K) float32 logits over the draft vocabulary, on h's device."""
        logits = torch.nn.functional.linear(h.to(self.weight.device, self.weight.dtype), self.weight, self.bias)
        return logits.float().to(h.device)

    @property
    def size(self) -> int:
        """Tokens a position can draft among."""
        return len(self.ids)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Positions in the draft vocabulary -> token ids (on index's device)."""
        return self.ids.to(index.device)[index]

    def full_log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., K) draft logits -> (..., V) log-probabilities, -inf outside the draft vocabulary."""
        out = torch.full((*logits.shape[:-1], self.vocab_size), float("-inf"), device=logits.device)
        return out.index_copy_(-1, self.ids.to(logits.device), torch.log_softmax(logits, dim=-1))


def check_draft_vocab(vocab, top_k: int) -> None:
    """`vocab`: what a draft step chooses among (a projection with a `size`, a list of them, or None: everything)."""
    items = [] if vocab is None else vocab if isinstance(vocab, list) else [vocab]
    if items and min(v.size for v in items) < top_k:
        what = "eval.head_candidates" if isinstance(items[0], TwoStageProjection) else "the draft vocabulary"
        raise ValueError(f"{what}: {min(v.size for v in items)} tokens, fewer than the top {top_k} a tree drafts")


def own_projection(
    drafter: torch.nn.Module, vocab: torch.Tensor | TwoStageProjection | None, two_stage: bool
) -> VocabProjection | TwoStageProjection:
    """A drafter's own head over its draft vocabulary (sorted ids), or `vocab`'s N most frequent of them (they must
    be among its own), or the two-stage projection of that head as given."""
    if two_stage:
        return vocab
    own = drafter.draft_ids
    rows = None
    if vocab is not None:
        if not bool(drafter.t2d[vocab.to(drafter.t2d.device)].all()):
            raise ValueError(f"eval.draft_vocab: {len(vocab)} tokens, not all among its own {len(own)} draft tokens")
        rows = torch.searchsorted(own, vocab.to(own.device))
    return VocabProjection.trained(drafter.lm_head, own, drafter.target_vocab_size, rows)


def vocab_suffix(draft_vocab) -> tuple[bool, str]:
    """(whether `draft_vocab` is a two-stage projection list, its part of a tree's description)."""
    if draft_vocab is not None and not isinstance(draft_vocab, torch.Tensor):
        return True, f", two-stage head r{draft_vocab[0].head.a.shape[1]} c{draft_vocab[0].head.candidates}"
    return False, "" if draft_vocab is None else f", draft vocab {len(draft_vocab)}"
