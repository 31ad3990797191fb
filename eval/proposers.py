"""Drafters as the speculative loop uses them: the `Proposer` contract, the EAGLE-2, Medusa and P-EAGLE proposers.

    proposer, desc = build_proposer(METHODS[method], drafter, recipe.eval, calibrate, draft_vocab)  # per `eval.tree`
    proposer.reset(batch_size)
    trees = proposer.propose([DecodeState(tokens=row_tokens, new_hidden=row_hidden), ...])  # one tree per row
    proposer.commit(paths)  # the accepted node indices of each row's tree, root first

`eval.decode` runs the loop: it calls `reset(B)`, then each round `propose` with the states of the rows still
decoding, `commit` with their accepted paths, and `keep_rows` when some rows finish. `EagleProposer`,
`MedusaProposer` and `ParallelProposer` draft every row of a batch in the same forwards (the last two fill static
trees, `StaticTreeProposer`, whose calibration `parallel_rank_accuracy` measures for P-EAGLE); `VocabProjection`
restricts drafting to a draft vocabulary (`eval.draft_vocab`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from eval.cost_trees import batch_should_stop, batch_tree_size
from eval.heads import TwoStageProjection
from eval.trees import NAMED_TREES, Tree, calibrated_tree, chain, dynamic_trees, medusa_tokens, medusa_tree
from models.methods import Method
from schema.evaluation import EvalConfig


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


def _check_draft_vocab(vocab, top_k: int) -> None:
    """`vocab`: what a draft step chooses among (a projection with a `size`, a list of them, or None: everything)."""
    items = [] if vocab is None else vocab if isinstance(vocab, list) else [vocab]
    if items and min(v.size for v in items) < top_k:
        what = "eval.head_candidates" if isinstance(items[0], TwoStageProjection) else "the draft vocabulary"
        raise ValueError(f"{what}: {min(v.size for v in items)} tokens, fewer than the top {top_k} a tree drafts")


class StaticTreeProposer:
    """A static tree filled from per-depth top-k lists: the node at depth k with rank r gets depth k's r-th most
    likely token. Subclasses give the lists (`depth_topk`); node scores are log-probabilities summed down the path
    (each depth's list is drafted independently of the tokens above it)."""

    draft_steps = 1  # one drafter forward per round

    def __init__(self, tree: Tree, total_tokens: int | None = None):
        """`total_tokens`: with `costs` set (`eval.tree: cost`), `tree` is the envelope of candidates and each round
        keeps the best ones by path probability, as many as pay for themselves (`batch_tree_size`), at most this
        many tree tokens."""
        self.tree = tree
        self.top_k = int(tree.head_rank.max()) + 1
        self.costs = None  # eval.cost_trees.Costs: prune the tree each round instead of drafting it whole
        self.total_tokens = total_tokens or tree.num_nodes

    def depth_topk(self, states: Sequence[DecodeState]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> each depth's top_k token ids and their log-probabilities, (B, D, top_k) each, D = tree.max_depth."""
        raise NotImplementedError

    def reset(self, batch_size: int) -> None:
        pass

    def propose_scored(
        self, states: Sequence[DecodeState], rank_fn: RankFn | None = None
    ) -> tuple[list[Tree], list[torch.Tensor]]:
        """Each row's tree and its nodes' log path probabilities (no early stop for `rank_fn` to inform: one forward
        drafts every depth)."""
        ids, logp = self.depth_topk(states)
        roots = torch.cat([state.tokens[:, -1] for state in states]).to(ids.device)
        tokens = medusa_tokens(self.tree, roots, ids)  # (B, N)
        # a node's score: its depth's log-probability of its token, summed down its path
        par, depth, rank = self.tree.parents.tolist(), self.tree.depth.tolist(), self.tree.head_rank.tolist()
        scores = logp.new_zeros(logp.shape[0], len(par), dtype=torch.float64)
        for i in range(1, len(par)):
            scores[:, i] = scores[:, par[i]] + logp[:, depth[i] - 1, rank[i]]
        if self.costs is None:
            return [dataclasses.replace(self.tree, tokens=row) for row in tokens], list(scores.cpu())
        probs = scores[:, 1:].exp().cpu()  # (B, N - 1) the candidates' path probabilities
        ranked = probs.sort(dim=-1, descending=True).values.tolist()
        size = batch_tree_size(ranked, self.costs, self.draft_steps, self.total_tokens)
        trees, kept = [], []
        for b in range(len(states)):
            # best first, parents before children on equal probability: every prefix of this order is connected
            order = sorted(range(len(par) - 1), key=lambda c: (-float(probs[b, c]), c))[: size - 1]
            nodes = sorted(c + 1 for c in order)  # tree node ids, creation order (parents first)
            index = {node: j + 1 for j, node in enumerate(nodes)}
            sub = [-1] + [0 if par[node] == 0 else index[par[node]] for node in nodes]
            ranks = [-1] + [rank[node] for node in nodes]
            trees.append(Tree.from_parents(sub, tokens[b, [0, *nodes]].tolist(), ranks).to(tokens.device))
            kept.append(scores[b, [0, *nodes]].cpu())
        return trees, kept

    def propose(self, states: Sequence[DecodeState]) -> list[Tree]:
        return self.propose_scored(states)[0]

    def commit(self, paths: Sequence[list[int]]) -> None:
        pass

    def keep_rows(self, rows: list[int]) -> None:
        pass


class MedusaProposer(StaticTreeProposer):
    """Medusa heads fill a static tree: node at depth k with rank r gets head k's r-th most likely token.

    The heads read the target's last hidden state at the last cached position (the one that chose the root):
    head k predicts the token k positions after the root. Stateless: every row of a batch drafts in one pass.
    """

    feature_layers = [-1]

    def __init__(
        self,
        heads: torch.nn.Module,
        tree: Tree,
        draft_vocab: torch.Tensor | Sequence[TwoStageProjection] | None = None,
        total_tokens: int | None = None,
    ):
        """`draft_vocab`: token ids whose rows of every head's projection it drafts from, or one ready projection per
        head (the two-stage heads); None: the whole vocabulary. `total_tokens`: see `StaticTreeProposer`."""
        if tree.max_depth > heads.cfg.num_heads:
            raise ValueError(f"tree depth {tree.max_depth} exceeds the number of Medusa heads ({heads.cfg.num_heads})")
        super().__init__(tree, total_tokens)
        self.heads = heads
        self.vocab = None  # per head the tree reaches: its projection restricted to the draft vocabulary
        if isinstance(draft_vocab, torch.Tensor):
            self.vocab = [VocabProjection(heads.projection(k), draft_vocab) for k in range(1, tree.max_depth + 1)]
        elif draft_vocab is not None:
            self.vocab = list(draft_vocab)[: tree.max_depth]
        _check_draft_vocab(self.vocab, self.top_k)

    def depth_topk(self, states: Sequence[DecodeState]) -> tuple[torch.Tensor, torch.Tensor]:
        last = torch.cat([state.new_hidden[:, -1:, 0] for state in states])  # (B, 1, d)
        if self.vocab is None:
            logits = self.heads.head_logits(last, self.tree.max_depth)[:, :, 0]  # (D, B, V): the heads the tree reaches
            top = logits.topk(self.top_k, dim=-1).indices  # (D, B, top_k)
            logp = logits.float().log_softmax(dim=-1).gather(-1, top)
            return top.transpose(0, 1), logp.transpose(0, 1)  # (B, D, top_k)
        ids, logp = [], []
        for k, vocab in enumerate(self.vocab, 1):
            logits = vocab(self.heads.head_state(k, last[:, 0]))  # (B, K)
            top = logits.topk(self.top_k, dim=-1).indices  # (B, top_k) rows of the projection
            ids.append(vocab.token_ids(top))  # token ids
            logp.append(logits.float().log_softmax(dim=-1).gather(-1, top))
        return torch.stack(ids, dim=1), torch.stack(logp, dim=1)  # (B, D, top_k)


class ParallelProposer(StaticTreeProposer):
    """P-EAGLE drafting for a batch of rows: one drafter forward per round catches up on the target features of the
    newly verified tokens and runs the `parallel_tokens - 1` mask slots after them; the last real position and mask
    slot j give the logits of depths 1 and j + 1, whose top-k fill a static tree.

    The drafter's KV cache holds each row's verified prefix, packed as `EagleProposer`'s: a round's new real
    positions are padded to the longest row's, the mask slots follow the padding; each row's mask slot j stands at
    its last real position + j and sees its own prefix, its own real positions and mask slots 1..j. Padding and mask
    slots leave the cache after the forward (the next round re-runs the accepted tokens with the target's features).
    """

    def __init__(
        self,
        drafter: torch.nn.Module,
        tree: Tree,
        vocab: VocabProjection | TwoStageProjection,
        window: int | None = None,
        total_tokens: int | None = None,
    ):
        """`vocab`: the projection of the drafter's final-norm outputs onto the draft tokens (its own head, a subset
        of its rows, or the two-stage head). `window`: the drafter attends to fewer than this many positions back.
        `total_tokens`: see `StaticTreeProposer`."""
        if tree.max_depth > drafter.cfg.parallel_tokens:
            raise ValueError(
                f"tree depth {tree.max_depth} exceeds the tokens one drafter forward drafts "
                f"(drafter.parallel_tokens: {drafter.cfg.parallel_tokens})"
            )
        super().__init__(tree, total_tokens)
        self.drafter, self.vocab, self.window = drafter, vocab, window
        self.feature_layers = list(drafter.cfg.feature_layers)
        _check_draft_vocab(vocab, self.top_k)
        self.reset(1)

    def reset(self, batch_size: int) -> None:
        self.cache = self.drafter.new_cache()
        self.lengths = [0] * batch_size  # per row: cached positions that are its own

    def depth_topk(self, states: Sequence[DecodeState]) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.forward(states)  # (B, D, d)
        logits = self.vocab(normed)  # (B, D, K)
        top = logits.topk(self.top_k, dim=-1).indices  # (B, D, top_k) rows of the projection
        logp = logits.float().log_softmax(dim=-1).gather(-1, top)
        return self.vocab.token_ids(top), logp

    def forward(self, states: Sequence[DecodeState]) -> torch.Tensor:
        """The round's one drafter forward; -> final-norm outputs (B, D, d) of the last real position (depth 1) and of
        the first D - 1 mask slots (depths 2..D), D = the tree's depth."""
        feats = [state.new_hidden.flatten(2) for state in states]  # (1, n_b, n_feat·d) each
        counts = [f.shape[1] for f in feats]
        bsz, n, slots = len(states), max(counts), self.tree.max_depth - 1
        device, cached = feats[0].device, self.cache.length
        width = n + slots
        inputs = feats[0].new_zeros(bsz, width, feats[0].shape[2], dtype=self.drafter.compute_dtype)
        ids = torch.full((bsz, width), self.drafter.cfg.mask_token_id, dtype=torch.long, device=device)
        positions = torch.zeros(bsz, width, dtype=torch.long, device=device)
        inputs[:, n:] = self.drafter.mask_hidden.detach().to(inputs.dtype)
        for b, (state, f, m) in enumerate(zip(states, feats, counts)):
            inputs[b, :m], ids[b, :m] = f[0], state.tokens[0, -m:]
            last = state.prefix_len - 1  # the last real position: it reads the root
            positions[b, :n] = last - m + 1 + torch.arange(n, device=device)  # past m: padding
            positions[b, n:] = last + 1 + torch.arange(slots, device=device)
        count = torch.tensor(counts, device=device)
        key = torch.arange(width, device=device)
        real_key = key[None, :] < count[:, None]  # (B, width): a row's own real positions
        causal = key[None, :] <= key[:, None]  # (width, width)
        is_mask = key >= n
        # real queries: causal over their row's real keys; mask slots: every real key of the row, causal among slots
        new = causal[None] & (real_key[:, None, :] | (is_mask[None, :] & is_mask[:, None])[None])
        new |= torch.eye(width, dtype=torch.bool, device=device)  # padded positions see themselves: no empty row
        own = torch.arange(cached, device=device) < torch.tensor(self.lengths, device=device)[:, None]  # (B, S)
        mask = torch.cat([own[:, None, :].expand(-1, width, -1), new], dim=-1)  # (B, width, S + width)
        identity = lambda h: h  # noqa: E731  the final-norm outputs, projected below at the positions that draft
        normed, _ = self.drafter.step(inputs, ids, positions, self.cache, mask, project=identity, window=self.window)
        if any(m != n for m in counts) or any(length != cached for length in self.lengths):
            keep = [list(range(length)) + list(range(cached, cached + m)) for length, m in zip(self.lengths, counts)]
            longest = max(len(k) for k in keep)
            self.cache.select(torch.tensor([k + [0] * (longest - len(k)) for k in keep], device=device))  # packed
        else:
            self.cache.crop(cached + n)  # the mask slots go
        self.lengths = [length + m for length, m in zip(self.lengths, counts)]
        at = torch.cat([(count - 1)[:, None], n + torch.arange(slots, device=device).expand(bsz, -1)], dim=1)
        return normed[torch.arange(bsz, device=device)[:, None], at]  # (B, D, d)

    def keep_rows(self, rows: list[int]) -> None:
        self.cache.keep_rows(torch.tensor(rows, dtype=torch.long))
        self.lengths = [self.lengths[r] for r in rows]
        self.cache.crop(max(self.lengths, default=0))


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
        to fewer than this many positions back (`models.eagle.windowed`); None: the whole context."""
        self.drafter, self.window = drafter, window
        self.feature_layers = list(drafter.cfg.feature_layers)
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        if isinstance(draft_vocab, torch.Tensor):
            draft_vocab = VocabProjection(drafter.lm_head, draft_vocab)
        _check_draft_vocab(draft_vocab, top_k)
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


MAX_COST_CANDIDATES = 1024
"""A cost-aware static tree scores every rank path each round: at most this many."""


def static_tree(ev: EvalConfig, depths: int, calibrate: Callable[[int], torch.Tensor]) -> tuple[Tree, str]:
    """`eval.tree` as a static tree over `depths` per-depth top-k lists, and its description: a chain, a named tree,
    or (auto, calibrated) one grown from the measured rank accuracies `calibrate(top_k)` (depths, top_k)."""
    tree = ev.tree
    depth = min(ev.tree_depth, depths)
    if tree == "chain":
        return chain(depth), f"chain d{depth}"
    if tree in NAMED_TREES:
        return medusa_tree(NAMED_TREES[tree], depths), tree
    if tree == "cost":  # every rank path: each round keeps the candidates that pay (the caller measures the costs)
        k = ev.tree_top_k
        if sum(k**d for d in range(1, depth + 1)) > MAX_COST_CANDIDATES:
            raise ValueError(
                f"eval.tree: cost drafts all {k}^1 + ... + {k}^{depth} rank paths of eval.tree_top_k {k} over depth "
                f"{depth}, more than {MAX_COST_CANDIDATES}; lower eval.tree_top_k or eval.tree_depth"
            )
        paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
        return medusa_tree(paths, depths), f"cost-aware d{depth} k{k} n{ev.tree_total_tokens}"
    static = calibrated_tree(calibrate(ev.tree_top_k)[:depth], ev.tree_total_tokens - 1)
    return static, f"calibrated d{static.max_depth} n{static.num_nodes}"


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


@torch.inference_mode()
def parallel_rank_accuracy(
    drafter: torch.nn.Module, sequences: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], top_k: int
) -> torch.Tensor:
    """(K, top_k) measured P(depth k's rank-r token is right) of a P-EAGLE drafter, teacher-forced: the calibration of
    its static tree. `sequences` yields (the target's hidden states at `drafter.stored_layers` (T, S, d), token ids
    (T,), scored (T,) bool); depth k + 1 (unrolled step k) at position t predicts token t + k + 2."""
    K = drafter.cfg.parallel_tokens
    hits, counts = torch.zeros(K, top_k), torch.zeros(K)
    for hidden, ids, scored in sequences:
        T = len(ids)
        device = drafter.d2t.device
        batch = {
            "input_ids": ids[None].to(device),
            "loss_mask": scored[None].to(device),
            "attention_mask": torch.ones(1, T, dtype=torch.long, device=device),
            "position_ids": torch.arange(T, device=device)[None],
            "hidden": hidden[None].to(device),
        }
        for k, normed in enumerate(drafter.unroll(batch)):
            pos = torch.nonzero(scored[k + 2 :]).flatten()  # t such that token t + k + 2 is scored
            if pos.numel() == 0:
                continue
            top = drafter.draft_ids[drafter.draft_logits(normed[0, pos.to(device)]).topk(top_k, dim=-1).indices]
            hits[k] += (top.cpu() == ids[pos + k + 2, None].cpu()).sum(0).float()
            counts[k] += pos.numel()
    return hits / counts.clamp(min=1)[:, None]
