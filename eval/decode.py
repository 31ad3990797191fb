"""Speculative decoding with a tree of drafts and a KV-cached target: the loop and its statistics.

    settings = DecodeSettings(max_new_tokens=64)   # temperature 0: greedy
    out = speculative_generate(model, proposer, prompt_ids, settings, kernels="triton")  # or "reference"
    out.tokens, out.stats()["accept_len"]

Proposers (what drafts) are in `eval.proposers`, the target side of the loop (forwards, tree masks, KV commits) in
`eval.target_runner`; the plain baselines this loop is checked against are in
`eval.baselines` and share none of its target-side code.

One round, with the root r (the last token chosen by the target, not yet in its KV cache) at position P:
  1. the proposer returns a `Tree` rooted at r (node 0);
  2. one target forward over the N tree tokens at positions P + depth, attending to the whole cached
     prefix and, inside the tree, to ancestors only (tree attention kernel, or an additive 4D mask);
  3. `ops.verify_*` walks the tree with the target's processed distributions: the accepted path plus
     one bonus token drawn from the target itself, so every round yields accepted + 1 tokens;
  4. `ops.kv_commit` moves the accepted path's KV rows in place of the tree block and drops the rest;
     the proposer sees the accepted path and the target hidden states along it.
Greedy output equals plain greedy decoding token for token; sampled output follows the target
distribution (lossless); `acceptance="typical"` is Medusa's lossy typical acceptance.

Batches: `speculative_generate_batch(model, proposer, prompts, settings)` decodes B prompts of any lengths
together, the proposer drafting one tree per row. Each round the B trees are verified in one target forward; rows accept
different lengths, so the target cache is ragged: row b owns its first `lengths[b]` positions, the tree block
is appended after the longest row, tree attention sees only each row's own prefix, and `kv_commit` moves the
accepted rows down to each row's prefix end. `EagleProposer` and `MedusaProposer` draft every row in the same
forwards; finished rows leave the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from data.repeats import repeating
from eval.kernels import TreeOps
from eval.proposal import DecodeState, Proposer
from eval.reference import sample_from, target_probs
from eval.target_runner import Kernels, TargetRunner, clock
from eval.trees import Tree, stack_trees
from schema.evaluation import EvalConfig, SamplingConfig


@dataclass
class DecodeSettings(SamplingConfig):
    """How to decode (the recipe's sampling fields, plus stop tokens and the seed); greedy when temperature == 0."""

    eos_token_ids: list[int] = field(default_factory=list)
    seed: int = 0

    @classmethod
    def from_recipe(cls, ev: EvalConfig, eos_token_ids: Sequence[int]) -> DecodeSettings:
        """The settings of a recipe's `eval` section."""
        shared = {f.name: getattr(ev, f.name) for f in fields(SamplingConfig)}
        return cls(**shared, eos_token_ids=list(eos_token_ids), seed=ev.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenerationResult:
    """One prompt's decode: generated tokens and per-round bookkeeping."""

    tokens: list[int]
    """Generated tokens (prompt excluded; the EOS token is kept when hit)."""
    accepted: list[int] = field(default_factory=list)
    """Per verification round: accepted draft tokens (the round yields accepted + 1 tokens)."""
    tree_depth: list[int] = field(default_factory=list)
    """Per round: depth of the proposed tree (the most that could have been accepted)."""
    extendable: list[bool] = field(default_factory=list)
    """Per round: whether the last accepted node had children (a deeper draft was offered and rejected), i.e. the
    round ended by a rejection rather than by running out of tree."""
    tree_nodes: list[int] = field(default_factory=list)
    """Per round: tokens of the verified tree (root included)."""
    round_s: list[float] = field(default_factory=list)
    """Per round: seconds from drafting to the committed result (the batch's, shared by its rows)."""
    target_forwards: int = 0
    wall_s: float = 0.0
    target_s: float = 0.0
    draft_s: float = 0.0

    def stats(self) -> dict[str, Any]:
        return round_stats(self.accepted, self.extendable) | {
            "new_tokens": len(self.tokens),
            "target_forwards": self.target_forwards,
            "forwards_per_token": self.target_forwards / max(len(self.tokens), 1),
            "tokens_per_s": len(self.tokens) / max(self.wall_s, 1e-9),
            "wall_s": self.wall_s,
        }


def round_stats(accepted: list[int], extendable: list[bool]) -> dict[str, Any]:
    """τ = mean over rounds of (accepted + 1), and the conditional acceptance rate per depth.

    `accept_rate_by_depth[d-1]` = P(a depth-d draft is accepted | its parent at depth d-1 was accepted and has
    children): a round counts at depth d if it accepted d tokens or more, or accepted d - 1 and the last accepted
    node had children (`extendable`), so branches that end early do not count as rejections. `reached_by_depth[d-1]`
    is the number of such rounds (the rate's denominator); rates with no such round, and τ without rounds, are None.
    """
    max_depth = max((a + e for a, e in zip(accepted, extendable)), default=0)
    reached = [sum(a >= d or (a == d - 1 and e) for a, e in zip(accepted, extendable)) for d in range(1, max_depth + 1)]
    passed = [sum(a >= d for a in accepted) for d in range(1, max_depth + 1)]
    return {
        "rounds": len(accepted),
        "accept_len": sum(a + 1 for a in accepted) / len(accepted) if accepted else None,
        "accept_rate_by_depth": [p / r if r else None for p, r in zip(passed, reached)],
        "reached_by_depth": reached,
    }


def rounds_in_loop(tokens: list[int], accepted: list[int]) -> list[bool]:
    """Per round (`accepted`: tokens accepted per round, each round emitting accepted + 1 of `tokens`): whether the
    output's last tokens before the round repeat earlier output (`data.repeats.repeating`), i.e. the target is in a
    loop and the round's tokens are most likely a copy (greedy decoding of a small target often ends in one)."""
    repeats = repeating(tokens)
    flags, start = [], 0
    for a in accepted:
        flags.append(start > 0 and repeats[start - 1])
        start += a + 1
    return flags


# --------------------------------------------------------------------------------------------
# The loop


class PositionCoins:
    """One uniform per output position of each row, drawn from a generator seeded with the row's seed: the coin that
    draws the row's t-th new token, in plain sampling (`eval.baselines`) and in speculative verification (target-only
    acceptance emits the token at depth d of a round with the coin of its output position). Each token is still an
    exact draw from the target's distribution, and wherever both decoders compute the same distribution they emit
    the same token: sampled decoding gets a token-for-token lossless check, as greedy decoding does."""

    def __init__(self, seeds: Sequence[int], settings: DecodeSettings, device: torch.device):
        count = settings.max_new_tokens + 1
        draws = [torch.rand(count, generator=torch.Generator().manual_seed(int(seed))) for seed in seeds]
        self.u = torch.stack(draws).to(device)  # (B, max_new_tokens + 1), on the CPU generator whatever the device

    def at(self, rows: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """(len(rows),) coins: row rows[i]'s at output position positions[i] (past the last: the last, whose token
        is cut by max_new_tokens anyway)."""
        last = self.u.shape[1] - 1
        return self.u[list(rows), [min(p, last) for p in positions]]


def sample_next(logits: torch.Tensor, settings: DecodeSettings, coins: torch.Tensor) -> torch.Tensor:
    """(B, V) last-position logits -> (B,) next tokens: the argmax, or the inverse-CDF draw of each row's coin (B,)
    from the processed distribution."""
    if settings.greedy:
        return logits.argmax(-1)
    return sample_from(target_probs(logits, settings.temperature, settings.top_p), coins)


def _finish(generated: list[int], new: list[int], settings: DecodeSettings) -> bool:
    """Append `new` to `generated`, cut at EOS / max_new_tokens; True when decoding is over."""
    for tok in new:
        generated.append(tok)
        if tok in settings.eos_token_ids or len(generated) >= settings.max_new_tokens:
            return True
    return False


def _coins(
    ops: TreeOps,
    trees: list[Tree],
    gens: Sequence[torch.Generator],
    device: torch.device,
    emitted: torch.Tensor,
) -> torch.Tensor:
    """Sampled verification's uniforms for B trees, zero-padded to the batch's (B, D+1, C): column 0 at depth d is
    the row's coin of output position (tokens so far) + d (`PositionCoins`, given as `emitted` (B, D+1)); the child
    tests' columns are drawn with the row's own generator for its own tree's shape (so a row uses the numbers it
    would use alone)."""
    rows = [ops.draw_coins(tree, 1, gen, device=gen.device) for tree, gen in zip(trees, gens)]  # shapes: host trees
    coins = torch.zeros(len(rows), max(r.shape[1] for r in rows), max(r.shape[2] for r in rows), device=device)
    for b, row in enumerate(rows):
        coins[b, : row.shape[1], : row.shape[2]] = row[0]
        coins[b, : row.shape[1], 0] = emitted[b, : row.shape[1]]
    return coins


def _verify(
    ops: TreeOps,
    tree: Tree,
    logits: torch.Tensor,
    settings: DecodeSettings,
    coins: Callable[[], torch.Tensor],
) -> tuple[list[int], torch.Tensor, list[int]]:
    """Target logits over B stacked trees (B, N, V) -> (accepted drafts per row, accepted nodes (B, D+1) root first,
    bonus token per row). `coins()` gives sampled verification its uniforms."""
    tokens = tree.tokens  # (B, N)
    if settings.greedy:
        accept_len, nodes, bonus = ops.verify_greedy(tokens, logits, tree)
    elif settings.acceptance == "typical":
        accept_len, nodes, bonus = ops.verify_typical(
            tokens, logits, tree, settings.typical_epsilon, settings.typical_delta, settings.temperature
        )
    else:
        accept_len, nodes, bonus = ops.verify_sampled(
            tokens, logits, tree, coins(), temperature=settings.temperature, top_p=settings.top_p
        )
    return accept_len.tolist(), nodes, bonus.tolist()


@torch.inference_mode()
def speculative_generate(
    model: torch.nn.Module,
    proposer: Proposer,
    prompt_ids: torch.Tensor,
    settings: DecodeSettings,
    kernels: Kernels = "reference",
    ops: TreeOps | None = None,
) -> GenerationResult:
    """Speculative decoding of one prompt ((1, L) ids) with `proposer` drafting and `model` verifying.

    `kernels` selects the tree attention + verification + commit implementation: "triton" (fused kernels, the
    model's attention switched to the registered tree kernel) or "reference" (PyTorch twins, an additive 4D mask
    under the model's own attention); both give the same tokens. `ops` overrides the op set (tests inject faults).
    """
    _check_one_prompt(prompt_ids)
    return speculative_generate_batch(model, proposer, [prompt_ids[0]], settings, kernels, ops)[0]


@torch.inference_mode()
def speculative_generate_batch(
    model: torch.nn.Module,
    proposer: Proposer,
    prompts: Sequence[torch.Tensor],
    settings: DecodeSettings,
    kernels: Kernels = "reference",
    ops: TreeOps | None = None,
    seeds: Sequence[int] | None = None,
) -> list[GenerationResult]:
    """Speculative decoding of B prompts ((L_b,) ids, any lengths) together: one result per prompt.

    `proposer` drafts for the whole batch (`EagleProposer` and `MedusaProposer` draft all rows in one pass; stubs
    written for one prompt run as a batch through `eval.checks.PerRow`). Each round the B trees, which must have the
    same node count, are verified in one target forward and committed into a ragged KV cache (see `TargetRunner`);
    rows leave the batch when they finish. Row b draws its samples with its own generator seeded `seeds[b]` (default
    `settings.seed + b`) and the uniforms of its own tree, so every row decodes what it decodes alone with that seed
    (greedy: plain greedy decoding of its prompt). Times (`wall_s`, `target_s`, `draft_s`) are the batch's, shared
    by its rows.
    """
    prompts, seeds = check_prompts(prompts, seeds, settings)
    device = prompts[0].device
    gens = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    positions = PositionCoins(seeds, settings, device)
    start = clock(device)
    target = TargetRunner(model, list(proposer.feature_layers), kernels, ops)
    ops = target.ops
    results = [GenerationResult(tokens=[]) for _ in prompts]
    proposer.reset(len(prompts))
    draft_s = 0.0

    try:
        logits, hidden = target.prefill(prompts)
        roots = sample_next(logits, settings, positions.at(range(len(prompts)), [0] * len(prompts))).tolist()
        tokens = [torch.cat([p, p.new_tensor([r])])[None] for p, r in zip(prompts, roots)]  # (1, L_b + 1) per row
        new_hidden = [None if hidden is None else hidden[b : b + 1, : p.shape[0]] for b, p in enumerate(prompts)]
        active = [b for b in range(len(prompts)) if not _finish(results[b].tokens, [roots[b]], settings)]
        if len(active) < len(prompts):
            target.keep_rows(active)
            proposer.keep_rows(active)
        while active:
            t0 = round_start = clock(device)
            trees = proposer.propose([DecodeState(tokens=tokens[b], new_hidden=new_hidden[b]) for b in active])
            draft_s += clock(device) - t0
            if len({t.num_nodes for t in trees}) != 1:
                sizes = {b: t.num_nodes for b, t in zip(active, trees)}
                raise ValueError(f"the trees of one round must have the same node count, got {sizes} (row: nodes)")
            tree = stack_trees([t.to(device) for t in trees])  # (B, N)
            logits, hidden = target.verify(tree)  # (B, N, V)
            depths = range(max(t.max_depth for t in trees) + 1)
            emitted = torch.stack([positions.at([b] * len(depths), [len(results[b].tokens) + d for d in depths])
                                   for b in active])  # fmt: skip
            coins = functools.partial(_coins, ops, trees, [gens[b] for b in active], device, emitted)
            accepted, nodes, bonus = _verify(ops, tree, logits, settings, coins)
            target.commit(nodes, accepted)
            node_rows, token_rows, first_child = nodes.tolist(), tree.tokens.tolist(), tree.first_child.tolist()
            paths = [row[: a + 1] for row, a in zip(node_rows, accepted)]  # node indices, root first, per row

            t0 = clock(device)
            proposer.commit(paths)
            now = clock(device)
            draft_s += now - t0

            still = []
            for i, (b, path) in enumerate(zip(active, paths)):
                new = [token_rows[i][node] for node in path[1:]] + [bonus[i]]
                result = results[b]
                result.accepted.append(accepted[i])
                result.tree_depth.append(trees[i].max_depth)
                result.extendable.append(first_child[i][path[-1]] >= 0)
                result.tree_nodes.append(tree.num_nodes)
                result.round_s.append(now - round_start)
                new_hidden[b] = hidden[i : i + 1, path] if hidden is not None else None  # (1, k+1, S, d)
                tokens[b] = torch.cat([tokens[b], torch.tensor([new], device=device)], dim=1)
                if not _finish(result.tokens, new, settings):
                    still.append(i)
            if len(still) < len(active):
                target.keep_rows(still)
                proposer.keep_rows(still)
            active = [active[i] for i in still]

        wall = clock(device) - start
        for result in results:
            result.target_forwards = 1 + len(result.accepted)
            result.target_s, result.wall_s, result.draft_s = target.seconds, wall, draft_s
    finally:
        target.close()
    return results


def check_prompts(
    prompts: Sequence[torch.Tensor], seeds: Sequence[int] | None, settings: DecodeSettings
) -> tuple[list[torch.Tensor], list[int]]:
    """Prompts as (L_b,) tensors and one seed per prompt (default settings.seed + row), or a clear error (the
    plain baselines check their input with this too: input checks, not decoding, are shared)."""
    if not prompts:
        raise ValueError("no prompts to decode")
    prompts = [p.reshape(-1) for p in prompts]
    if any(p.numel() == 0 for p in prompts):
        raise ValueError(f"empty prompt at batch row {next(i for i, p in enumerate(prompts) if p.numel() == 0)}")
    seeds = [settings.seed + b for b in range(len(prompts))] if seeds is None else list(seeds)
    if len(seeds) != len(prompts):
        raise ValueError(f"one seed per prompt: got {len(seeds)} seeds for {len(prompts)} prompts")
    return prompts, seeds


def _check_one_prompt(prompt_ids: torch.Tensor) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(
            f"prompt_ids must be (1, L), got shape {tuple(prompt_ids.shape)}; batches: speculative_generate_batch"
        )
