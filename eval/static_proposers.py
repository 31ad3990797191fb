"""Proposers that fill static trees from per-depth top-k lists: Medusa heads (`MedusaProposer`) and P-EAGLE's
mask slots (`ParallelProposer`), the trees they draft (`static_tree`: a chain, a named, calibrated or cost-aware
tree) and the calibration of P-EAGLE's trees (`parallel_rank_accuracy`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence

import torch

from eval.cost_trees import batch_tree_size
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
from eval.trees import NAMED_TREES, Tree, calibrated_tree, chain, medusa_tokens, medusa_tree
from schema.evaluation import EvalConfig


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
        self.window: int | None = None  # heads attend to nothing; ParallelProposer sets its drafter's
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
        check_draft_vocab(self.vocab, self.top_k)

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
        check_draft_vocab(vocab, self.top_k)
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


def build_medusa_proposer(
    method, drafter: torch.nn.Module, ev: EvalConfig, calibrate, draft_vocab=None, window=None
) -> tuple[Proposer, str]:
    """Medusa heads' static tree (`eval.tree`: auto, calibrated, chain, the named trees, cost); heads have no
    attention, so no window. See `eval.proposers.build_proposer` for the arguments."""
    _, suffix = vocab_suffix(draft_vocab)
    static, desc = static_tree(ev, drafter.cfg.num_heads, calibrate)
    return MedusaProposer(drafter, static, draft_vocab, ev.tree_total_tokens), f"{desc}{suffix}"


def build_parallel_proposer(
    method, drafter: torch.nn.Module, ev: EvalConfig, calibrate, draft_vocab=None, window=None
) -> tuple[Proposer, str]:
    """P-EAGLE's static tree over the depths of one forward (`eval.tree`: auto, calibrated, chain, the named trees,
    cost, up to `parallel_tokens` deep), through its own draft vocabulary."""
    two_stage, suffix = vocab_suffix(draft_vocab)
    vocab = draft_vocab
    if two_stage:
        (vocab,) = vocab  # one head: its own
    vocab = own_projection(drafter, vocab, two_stage)
    suffix = f", own draft vocab {len(drafter.d2t)}{suffix}" + ("" if window is None else f", window {window}")
    static, desc = static_tree(ev, drafter.cfg.parallel_tokens, calibrate)
    return ParallelProposer(drafter, static, vocab, window, ev.tree_total_tokens), f"{desc}{suffix}"


def parallel_calibration(drafter: torch.nn.Module, target, samples, top_k: int) -> torch.Tensor:
    """P-EAGLE's per-depth rank accuracy on calibration samples ((ids, scored) pairs), from the target's hidden states
    at the drafter's stored layers."""
    layers = list(drafter.stored_layers)
    features = ((target.hidden_states(ids[None].to(target.device), layers=layers)[0], ids, scored)
                for ids, scored in samples)  # fmt: skip
    return parallel_rank_accuracy(drafter, features, top_k)
