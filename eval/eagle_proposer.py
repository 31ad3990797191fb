"""The EAGLE proposer: a drafter drafting from its own feature recurrence, as an EAGLE-2 dynamic tree, a chain or a
cost-aware tree, every row of a batch in the same forwards."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eval.cost_trees import batch_should_stop, batch_tree_size
from eval.heads import TwoStageProjection
from eval.proposal import (
    DecodeState,
    Proposer,
    RankFn,
    VocabProjection,
    check_draft_vocab,
    own_projection,
    vocab_suffix,
)
from eval.trees import Tree, dynamic_trees


class EagleProposer:
    """EAGLE-2 drafting for a batch of rows: catch up on the target features of the newly verified tokens, then grow
    a dynamic tree per row (top_k expansion by cumulative draft log-probability for `depth` steps, `total_tokens`
    kept; top_k = 1 gives a chain), every row in the same drafter forwards.

    The drafter's KV cache holds each row's verified prefix, ragged like the target's: row b owns its first
    `lengths[b]` positions. A catch-up pads the rows' new positions to the longest and then packs each row's to its
    own prefix end; tree steps are appended under a per-row mask (own prefix + ancestors) and cropped away at commit,
    because the accepted tokens are re-run next round with the target's true features.
    """

    def __init__(
        self,
        drafter: torch.nn.Module,
        depth: int,
        top_k: int,
        total_tokens: int,
        draft_vocab: torch.Tensor | VocabProjection | TwoStageProjection | None = None,
        window: int | None = None,
    ):
        """`draft_vocab`: token ids whose rows of the drafter's lm_head it drafts from, or a ready projection (a
        drafter's own trained head, the two-stage head); None: the whole vocabulary. `window`: the drafter attends
        to fewer than this many positions back (`methods.eagle2.model.windowed`); None: the whole context."""
        self.drafter, self.window = drafter, window
        self.feature_layers = list(drafter.cfg.feature_layers)
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        if isinstance(draft_vocab, torch.Tensor):
            draft_vocab = VocabProjection(drafter.lm_head, draft_vocab)
        check_draft_vocab(draft_vocab, top_k)
        self.vocab = draft_vocab
        self.costs = None  # eval.cost_trees.Costs: keep the batch_tree_size best candidates, not total_tokens
        self.draft_steps = depth  # drafter forwards of the last round (fewer when a cost-aware tree stopped early)
        self.reset(1)

    def reset(self, batch_size: int) -> None:
        self.cache = self.drafter.new_cache()
        self.lengths = [0] * batch_size  # per row: cached positions that are its own
        self.committed = 0  # cache length after the last catch-up (tree steps start there)

    def _catch_up(self, states: Sequence[DecodeState]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every row's new target features on top of its cached prefix; -> logits at each row's last new position
        (B, V or K), f̂ there (B, d). Afterwards row b's cache is [its prefix | its new positions], packed."""
        feats = [state.new_hidden for state in states]  # (1, n_b, S, d) each
        counts = [f.shape[1] for f in feats]
        bsz, n = len(states), max(counts)
        device = feats[0].device
        cached = self.cache.length
        padded = any(m != n for m in counts)
        ragged = padded or any(length != cached for length in self.lengths)
        if not padded:
            inputs = torch.cat(feats)
            ids = torch.cat([state.tokens[:, -n:] for state in states])
            if bsz == 1:
                positions = torch.arange(states[0].prefix_len - n, states[0].prefix_len, device=device)[None]
            else:
                prefix = torch.tensor([state.prefix_len for state in states], device=device)
                positions = prefix[:, None] - n + torch.arange(n, device=device)  # (B, n)
        else:  # rows with fewer new positions are padded at the end
            inputs = feats[0].new_zeros(bsz, n, *feats[0].shape[2:])
            ids = torch.zeros(bsz, n, dtype=torch.long, device=device)
            positions = torch.zeros(bsz, n, dtype=torch.long, device=device)
            for b, (state, f, m) in enumerate(zip(states, feats, counts)):
                inputs[b, :m], ids[b, :m] = f[0], state.tokens[0, -m:]
                positions[b] = state.prefix_len - m + torch.arange(n, device=device)  # past m: padding
        mask, last = None, None  # without padding or stale rows: the step's own mask (causal, whole cache visible)
        if ragged:
            last = torch.tensor(counts, device=device) - 1
            own = torch.arange(cached, device=device) < torch.tensor(self.lengths, device=device)[:, None]  # (B, S)
            new = torch.arange(n, device=device)
            causal = (new[None, :] <= new[:, None]) & (new[None, :] < last[:, None, None] + 1)  # (B, n, n)
            causal |= torch.eye(n, dtype=torch.bool, device=device)  # padded positions see themselves: no empty row
            mask = torch.cat([own[:, None, :].expand(-1, n, -1), causal], dim=-1)  # (B, n, S + n)
        logits, hidden = self.drafter.step(
            inputs,
            ids,
            positions,
            self.cache,
            tree_mask=mask,
            project=self.vocab,
            logits_at=last if padded else None,
            last_only=not padded,
            window=self.window,
        )  # (B, 1, V or K), (B, n, d)
        if ragged:
            keep = [list(range(length)) + list(range(cached, cached + m)) for length, m in zip(self.lengths, counts)]
            width = max(len(k) for k in keep)
            self.cache.select(torch.tensor([k + [0] * (width - len(k)) for k in keep], device=device))  # packed
        self.lengths = [length + m for length, m in zip(self.lengths, counts)]
        self.committed = self.cache.length
        return logits[:, 0], (hidden[torch.arange(bsz, device=device), last] if padded else hidden[:, -1])

    def propose(self, states: Sequence[DecodeState]) -> list[Tree]:
        return self.propose_scored(states)[0]

    def propose_scored(
        self, states: Sequence[DecodeState], rank_fn: RankFn | None = None
    ) -> tuple[list[Tree], list[torch.Tensor]]:
        """With costs, the early stop weighs deeper drafting against `rank_fn`'s estimates (None: the candidates'
        own path probabilities)."""
        logits, hidden = self._catch_up(states)
        device, committed = hidden.device, self.committed
        if all(length == committed for length in self.lengths):
            own = torch.ones(len(states), committed, dtype=torch.bool, device=device)  # (B, S)
        else:
            own = torch.arange(committed, device=device) < torch.tensor(self.lengths, device=device)[:, None]
        prefix = torch.tensor([state.prefix_len for state in states], device=device)
        rows = {"hidden": hidden[:, None], "anc": torch.zeros(len(states), 1, 0, dtype=torch.bool, device=device)}

        def log_probs(step_logits: torch.Tensor) -> torch.Tensor:  # (B, F, V or K) -> (B, F, V)
            return (
                torch.log_softmax(step_logits, dim=-1) if self.vocab is None else self.vocab.full_log_probs(step_logits)
            )

        def expand(tokens: torch.Tensor, parent_rows: torch.Tensor, step: int) -> torch.Tensor:
            if step == 0:  # the root's children come from the catch-up's last position
                return log_probs(logits[:, None])  # (B, 1, V)
            parent_rows = parent_rows.to(device)
            f = tokens.shape[1]
            parent_anc = rows["anc"].gather(1, parent_rows[:, :, None].expand(-1, -1, rows["anc"].shape[2]))
            eye = torch.eye(f, dtype=torch.bool, device=device).expand(len(states), -1, -1)
            anc = torch.cat([parent_anc, eye], dim=2)  # (B, F, T + F) over the tree steps so far
            mask = torch.cat([own[:, None, :].expand(-1, f, -1), anc], dim=2)  # (B, F, S + T + F)
            pos = (prefix + step - 1)[:, None].expand(-1, f)  # the parent's position
            parent_hidden = rows["hidden"].gather(1, parent_rows[:, :, None].expand(-1, -1, hidden.shape[-1]))
            step_logits, step_hidden = self.drafter.step(
                parent_hidden,
                tokens.to(device),
                pos,
                self.cache,
                tree_mask=mask,
                from_target=False,
                project=self.vocab,
                window=self.window,
            )
            rows["hidden"], rows["anc"] = step_hidden, anc
            return log_probs(step_logits)  # (B, F, V)

        roots = torch.cat([state.tokens[:, -1] for state in states])
        size_fn = stop_fn = None
        steps = [self.depth]  # draft steps this round actually ran
        if self.costs is not None:

            def size_fn(scores: torch.Tensor) -> int:  # (B, n) log path probabilities -> one size for the batch
                ranked = scores.exp().sort(dim=-1, descending=True).values.tolist()
                return batch_tree_size(ranked, self.costs, steps[0], self.total_tokens)

            def stop_fn(
                scores: torch.Tensor, frontier: torch.Tensor, done: int, tokens: torch.Tensor, parents: torch.Tensor
            ) -> bool:
                if rank_fn is None:
                    ranked = scores.exp().sort(dim=-1, descending=True).values.tolist()
                else:
                    ranked = [rank_fn(b, tokens[b], parents[b], scores[b]) for b in range(len(scores))]
                best = frontier.exp().max(dim=-1).values.tolist()
                new = self.top_k * self.top_k
                stop = batch_should_stop(ranked, best, self.costs, done, new, self.depth - done, self.total_tokens)
                steps[0] = done if stop else steps[0]
                return stop

        scores: list[torch.Tensor] = []
        trees = dynamic_trees(expand, roots, self.depth, self.top_k, self.total_tokens, size_fn, stop_fn, scores)
        self.draft_steps = steps[0]
        return trees, scores

    def commit(self, paths: Sequence[list[int]]) -> None:
        self.cache.crop(self.committed)

    def keep_rows(self, rows: list[int]) -> None:
        self.cache.keep_rows(torch.tensor(rows, dtype=torch.long))
        self.lengths = [self.lengths[r] for r in rows]
        self.committed = max(self.lengths, default=0)
        self.cache.crop(self.committed)


def build_eagle_proposer(
    method, drafter: torch.nn.Module, ev, calibrate, draft_vocab=None, window=None
) -> tuple[Proposer, str]:
    """EAGLE-2 / EAGLE-3 drafting (`eval.tree`: auto, dynamic, chain, cost), through the drafter's own draft vocabulary
    when `method.own_vocab`; see `eval.proposers.build_proposer` for the arguments."""
    two_stage, suffix = vocab_suffix(draft_vocab)
    vocab = draft_vocab
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
    if ev.tree == "chain":
        return EagleProposer(
            drafter, ev.tree_depth, 1, ev.tree_depth + 1, vocab, window
        ), f"chain d{ev.tree_depth}{suffix}"
    k, n = ev.tree_top_k, ev.tree_total_tokens
    proposer = EagleProposer(drafter, ev.tree_depth, k, n, vocab, window)
    if ev.tree == "cost":  # the caller measures `proposer.costs` on the machine before decoding
        return proposer, f"cost-aware d{ev.tree_depth} k{k} n{n}{suffix}"
    return proposer, f"dynamic d{ev.tree_depth} k{k} n{n}{suffix}"
