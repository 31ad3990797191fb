"""Speculative decoding with a tree of drafts and a KV-cached target.

    settings = DecodeSettings(max_new_tokens=64)   # temperature 0: greedy
    out = speculative_generate(model, proposer, prompt_ids, settings, kernels="triton")  # or "reference"
    out.tokens, out.stats()["accept_len"]

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

Batches: `speculative_generate_batch(model, proposers, prompts, settings)` decodes B prompts of any lengths
together, one proposer per prompt. Each round the B trees are verified in one target forward; rows accept
different lengths, so the target cache is ragged: row b owns its first `lengths[b]` positions, the tree block
is appended after the longest row, tree attention sees only each row's own prefix, and `kv_commit` moves the
accepted rows down to each row's prefix end. Drafting still runs row by row (a batched EAGLE-2 tree is not
built yet); finished rows leave the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from eval.kernels import TreeOps, get_ops, register_tree_attention, tree_context
from eval.reference import target_probs
from eval.trees import Tree, dynamic_trees, medusa_tokens, stack_trees

Kernels = Literal["triton", "reference"]


@dataclass
class DecodeSettings:
    """How to decode; greedy when temperature == 0."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    acceptance: Literal["exact", "typical"] = "exact"
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    eos_token_ids: list[int] = field(default_factory=list)
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


class Proposer(Protocol):
    """A drafter as the decoding loop uses it (EAGLE-2, Medusa heads, test stubs), for a batch of rows.

    The loop calls `reset(B)`, then each round `propose` with the states of the rows still decoding, `commit` with
    their accepted paths, and `keep_rows` when some rows finish. A drafter written for one prompt at a time subclasses
    `RowProposer`; `PerRow` runs several of those (or any proposers) as one batch.
    """

    feature_layers: list[int]
    """Target hidden-state indices (HF convention) the proposer reads from `DecodeState.new_hidden`."""

    def reset(self, batch_size: int) -> None:
        """Forget previous prompts: the next round drafts for `batch_size` new rows."""

    def propose(self, states: Sequence[DecodeState]) -> list[Tree]:
        """Draft one tree per row, rooted at `states[b].tokens[:, -1]`."""

    def commit(self, paths: Sequence[list[int]]) -> None:
        """Per row, the target accepted `paths[b]` (node indices of its last proposed tree, root first)."""

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows (indices among the current ones, in order) decode on; the others finished."""


class RowProposer:
    """Base of a drafter written for one prompt (stubs, scripted drafters): implement `propose_row(state) -> Tree`,
    and `reset_row()` / `commit_row(path)` if it keeps state. It is a batch of one; `PerRow` batches several."""

    feature_layers: list[int] = []

    def reset(self, batch_size: int) -> None:
        if batch_size != 1:
            raise ValueError(f"{type(self).__name__} drafts for one prompt; give one per prompt (PerRow)")
        self.reset_row()

    def propose(self, states: Sequence[DecodeState]) -> list[Tree]:
        return [self.propose_row(state) for state in states]

    def commit(self, paths: Sequence[list[int]]) -> None:
        for path in paths:
            self.commit_row(path)

    def keep_rows(self, rows: list[int]) -> None:
        pass

    def reset_row(self) -> None:
        pass

    def propose_row(self, state: DecodeState) -> Tree:
        raise NotImplementedError

    def commit_row(self, path: list[int]) -> None:
        pass


class PerRow:
    """A batch proposer whose row b is `proposers[b]`, run as a batch of one (each keeps its own state)."""

    def __init__(self, proposers: Sequence[Proposer]):
        if len({id(p) for p in proposers}) != len(proposers):
            raise ValueError("PerRow: proposers keep per-prompt state; pass a distinct proposer per prompt")
        layers = {tuple(p.feature_layers) for p in proposers}
        if len(layers) > 1:
            raise ValueError(f"PerRow: the proposers of one batch must read the same target layers, got {layers}")
        self.proposers = list(proposers)
        self.rows = list(proposers)
        self.feature_layers = list(proposers[0].feature_layers) if proposers else []

    def reset(self, batch_size: int) -> None:
        if batch_size != len(self.proposers):
            raise ValueError(f"one proposer per prompt: got {len(self.proposers)} proposers for {batch_size} prompts")
        self.rows = list(self.proposers)
        for proposer in self.rows:
            proposer.reset(1)

    def propose(self, states: Sequence[DecodeState]) -> list[Tree]:
        return [proposer.propose([state])[0] for proposer, state in zip(self.rows, states)]

    def commit(self, paths: Sequence[list[int]]) -> None:
        for proposer, path in zip(self.rows, paths):
            proposer.commit([path])

    def keep_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]


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


# --------------------------------------------------------------------------------------------
# Target side: forwards with a DynamicCache, tree masks, KV commit


def clock(device: torch.device | str) -> float:
    """perf_counter after the device's queued work has finished: on a GPU, kernels run asynchronously, and a
    span timed without synchronizing would hold only their launches (their run time landing in the next span)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def tree_attention_mask(
    tree: Tree, prefix_len: int, dtype: torch.dtype, prefix_lens: torch.Tensor | None = None
) -> torch.Tensor:
    """(B or 1, 1, N, prefix_len + N) additive float mask: the cached prefix is visible (row b: only its first
    prefix_lens[b] positions, when given), tree nodes see their ancestors.

    Additive (0 / finfo.min), never bool: eager attention adds a user-supplied 4D mask as-is.
    """
    allowed = tree.dense_mask()  # (N, N) or (B, N, N)
    allowed = allowed if allowed.dim() == 3 else allowed[None]
    n, device = allowed.shape[-1], allowed.device
    seen = torch.ones(allowed.shape[0], prefix_len, dtype=torch.bool, device=device)
    if prefix_lens is not None:
        seen = torch.arange(prefix_len, device=device) < prefix_lens.to(device)[:, None]  # (B, P)
    visible = torch.cat([seen[:, None, :].expand(-1, n, -1), allowed], dim=-1)  # (B, N, P+N)
    return torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


def cache_arg(model: torch.nn.Module) -> str:
    """The name under which `model.forward` takes its KV cache: transformers renamed `past_key_values` to `cache`
    in 5.x, and an unknown name would be swallowed by **kwargs."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def select_cache_rows(cache: DynamicCache, rows: list[int]) -> None:
    """Keep only these batch rows of every layer (each on its own device under a `device_map`)."""
    index: dict[torch.device, torch.Tensor] = {}
    for layer in cache.layers:
        device = layer.keys.device
        if device not in index:
            index[device] = torch.tensor(rows, dtype=torch.long, device=device)
        layer.keys, layer.values = layer.keys[index[device]], layer.values[index[device]]


class TargetRunner:
    """The frozen target with its KV cache for a batch of rows: prefill, tree forwards, commits, dropping finished
    rows; `seconds` = time in forwards.

    Ragged layout: the cache tensors are (B, Hkv, S, D) with S the longest row; row b's first `lengths[b]` positions
    are its tokens and the rest are stale, never attended (tree attention takes per-row prefix lengths). A tree block
    is appended after S for every row, and `commit` moves each row's accepted KV rows to its own prefix end.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        feature_layers: list[int],
        kernels: Kernels = "reference",
        ops: TreeOps | None = None,
    ):
        self.model = model
        self.kernels = kernels
        self.ops = ops or get_ops(kernels)
        self.feature_layers = feature_layers
        self.attn_implementation = model.config._attn_implementation  # restored by `close`
        if kernels == "triton":  # tree blocks through the fused kernel; other blocks stay SDPA
            name = register_tree_attention(kind="triton")
            if model.config._attn_implementation != name:
                model.set_attn_implementation(name)
        self.cache = DynamicCache(config=model.config)
        self.cache_arg = cache_arg(model)
        self.lengths: list[int] = []  # per row: cached positions that are its own (the rest up to S are stale)
        self.tree_start = 0  # where the last tree block starts in the cache (S before it was appended)
        self.prefix_ends: int | torch.Tensor = 0  # the rows' prefix ends at the last tree: an int unless ragged
        self.forwards = 0
        self.seconds = 0.0

    def _run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        logits_to_keep: int | torch.Tensor,
        context: contextlib.AbstractContextManager,
        start: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model forward; `seconds` grows by the time since `start` (building the forward's mask included)."""
        with context:
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=True,
                **{self.cache_arg: self.cache},
                output_hidden_states=bool(self.feature_layers),
                logits_to_keep=logits_to_keep,
            )
        hidden, home = None, input_ids.device  # a device_map target ends on another GPU than it starts
        if self.feature_layers:
            hidden = torch.stack([out.hidden_states[i].to(home) for i in self.feature_layers], dim=2)  # (B, N, S, d)
        self.forwards += 1
        self.seconds += clock(home) - start
        return out.logits.to(home), hidden

    def prefill(self, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Fill the cache with B prompts ((L_b,) ids) -> logits at each prompt's last token (B, V), hidden
        (B, max L_b, S, d) or None. Shorter prompts are right-padded: under the causal mask a real token never sees
        the padding after it, and the padded positions become stale rows that later forwards do not attend to."""
        lengths = [int(p.shape[0]) for p in prompts]
        device = prompts[0].device
        L = max(lengths)
        ids = torch.zeros(len(prompts), L, dtype=torch.long, device=device)
        for row, p in enumerate(prompts):
            ids[row, : lengths[row]] = p
        positions = torch.arange(L, device=device)[None].expand(len(prompts), -1)
        self.lengths = lengths
        if len(set(lengths)) == 1:
            logits, hidden = self._run(ids, positions, None, 1, contextlib.nullcontext(), clock(device))
            return logits[:, -1], hidden
        # logits only at the distinct last positions ((B, K, V) with K <= B), then each row's own
        last = sorted(set(n - 1 for n in lengths))
        keep = torch.tensor(last)  # on the CPU: transformers indexes the last hidden states with it, and a
        # `device_map` target's last hidden states live on its last GPU (a CPU index is valid on every device)
        logits, hidden = self._run(ids, positions, None, keep, contextlib.nullcontext(), clock(device))
        pick = torch.tensor([last.index(n - 1) for n in lengths], device=device)
        return logits[torch.arange(len(lengths), device=device), pick], hidden

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A causal block (plain decoding; rows of equal cached length): (B, N) tokens at (B, N) positions after the
        cached rows -> logits (B, N, V), hidden (B, N, S, d) or None."""
        if any(length != self.cache.get_seq_length() for length in self.lengths):
            raise ValueError("a causal block needs rows of equal cached length; a ragged batch decodes trees")
        out = self._run(input_ids, position_ids, None, 0, contextlib.nullcontext(), clock(input_ids.device))
        self.lengths = [length + input_ids.shape[1] for length in self.lengths]
        return out

    def verify(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor | None]:
        """B stacked trees, each after its row's own prefix (positions prefix end + depth) -> logits (B, N, V),
        hidden (B, N, S, d) or None; tree attention sees each row's own prefix only."""
        start = clock(tree.tokens.device)
        self.tree_start = self.cache.get_seq_length()
        ragged = any(length != self.tree_start for length in self.lengths)
        self.prefix_ends = (
            torch.tensor(self.lengths, device=tree.tokens.device, dtype=torch.int32) if ragged else self.tree_start
        )  # one int when every row ends where the cache does
        lens = self.prefix_ends if ragged else None
        mask, context = None, contextlib.nullcontext()
        if self.kernels == "reference":
            mask = tree_attention_mask(tree, self.tree_start, self.model.dtype, lens)
        else:
            context = tree_context(tree.mask_bits, lens)
        return self._run(tree.tokens, tree.positions(self.prefix_ends), mask, 0, context, start)

    def close(self) -> None:
        """Give the model back its own attention implementation (plain baselines must not run through ours)."""
        if self.model.config._attn_implementation != self.attn_implementation:
            self.model.set_attn_implementation(self.attn_implementation)

    def commit(self, accepted_nodes: torch.Tensor, accept_len: list[int]) -> None:
        """After a tree forward: move each row's accepted KV rows (`accepted_nodes` (B, D+1), root first, -1
        padded; `accept_len` drafted nodes accepted per row) from the tree block to the row's prefix end in place
        (`ops.kv_commit`), then crop the cache to the longest row. Not timed as target time: it is the loop's."""
        layers = self.cache.layers
        keys, values = [x.keys for x in layers], [x.values for x in layers]
        ragged = not isinstance(self.prefix_ends, int)  # else every tree block starts at its row's prefix end
        self.ops.kv_commit(keys, values, self.prefix_ends, accepted_nodes, self.tree_start if ragged else None)
        self.lengths = [length + a + 1 for length, a in zip(self.lengths, accept_len)]
        self._crop(max(self.lengths))

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these batch rows (the others finished decoding) and crop to the longest kept row."""
        if rows == list(range(len(self.lengths))):
            return
        select_cache_rows(self.cache, rows)
        self.lengths = [self.lengths[r] for r in rows]
        self._crop(max(self.lengths, default=0))

    def _crop(self, length: int) -> None:
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]


# --------------------------------------------------------------------------------------------
# Decoding loops


def _first_token(logits: torch.Tensor, settings: DecodeSettings, gens: Sequence[torch.Generator]) -> torch.Tensor:
    """(B, V) last-position logits -> (B,) next token (argmax, or a sample of the processed distribution drawn
    with each row's own generator)."""
    if settings.greedy:
        return logits.argmax(-1)
    probs = target_probs(logits, settings.temperature, settings.top_p)
    return torch.cat([torch.multinomial(row[None], 1, generator=g) for row, g in zip(probs, gens)]).squeeze(-1)


def _finish(generated: list[int], new: list[int], settings: DecodeSettings) -> bool:
    """Append `new` to `generated`, cut at EOS / max_new_tokens; True when decoding is over."""
    for tok in new:
        generated.append(tok)
        if tok in settings.eos_token_ids or len(generated) >= settings.max_new_tokens:
            return True
    return False


@torch.inference_mode()
def plain_generate(model: torch.nn.Module, prompt_ids: torch.Tensor, settings: DecodeSettings) -> GenerationResult:
    """Plain autoregressive decoding of one prompt ((1, L) ids) with a KV cache: one target forward per token (the
    baseline)."""
    _check_one_prompt(prompt_ids)
    gen = torch.Generator(device=prompt_ids.device).manual_seed(settings.seed)
    start = clock(prompt_ids.device)
    target = TargetRunner(model, [])
    L = prompt_ids.shape[1]
    logits, _ = target.prefill([prompt_ids[0]])
    generated: list[int] = []
    while True:
        tok = _first_token(logits, settings, [gen])
        if _finish(generated, [int(tok)], settings):
            break
        logits, _ = target.forward(tok[:, None], torch.tensor([[L + len(generated) - 1]], device=tok.device))
        logits = logits[:, -1]
    return GenerationResult(
        tokens=generated,
        target_forwards=target.forwards,
        wall_s=clock(prompt_ids.device) - start,
        target_s=target.seconds,
    )


@torch.inference_mode()
def plain_generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[torch.Tensor],
    settings: DecodeSettings,
    seeds: Sequence[int] | None = None,
) -> list[GenerationResult]:
    """Plain decoding of B prompts ((L_b,) ids) together: the batch-B baseline, one target forward per token for
    the whole batch, as batched HF generation does it (left padding, a 2D padding mask, the model's own attention;
    none of the tree kernels), rows leaving the batch when they finish. Row b samples with its own generator seeded
    `seeds[b]` (default `settings.seed + b`), so every row decodes what `plain_generate` gives its prompt alone with
    that seed. Times are the batch's."""
    prompts, seeds = _check_batch(prompts, seeds, settings)
    device, lengths = prompts[0].device, [int(p.shape[0]) for p in prompts]
    gens = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    start = clock(device)
    L = max(lengths)
    pads = [L - n for n in lengths]  # left padding per row
    ids = torch.zeros(len(prompts), L, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), L, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, L - lengths[b] :], mask[b, L - lengths[b] :] = p, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    kwargs = {cache_arg(model): cache, "use_cache": True, "logits_to_keep": 1}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **kwargs).logits[:, -1].to(device)
    results = [GenerationResult(tokens=[]) for _ in prompts]
    active, next_pos = list(range(len(prompts))), torch.tensor(lengths, device=device)
    while True:
        toks = _first_token(logits, settings, [gens[b] for b in active])
        new = toks.tolist()
        still = [i for i, b in enumerate(active) if not _finish(results[b].tokens, [new[i]], settings)]
        if not still:
            break
        if len(still) < len(active):
            select_cache_rows(cache, still)
            keep = torch.tensor(still, device=device)
            toks, mask, next_pos, active = toks[keep], mask[keep], next_pos[keep], [active[i] for i in still]
            pads = [pads[i] for i in still]
            full = all(type(layer) is DynamicLayer for layer in cache.layers)  # not sliding-window layers
            if full and min(pads) > 0:  # padding columns no remaining row needs (positions are explicit)
                cut = min(pads)
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, cut:], layer.values[:, :, cut:]
                mask, pads = mask[:, cut:], [pad - cut for pad in pads]
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
        logits = model(input_ids=toks[:, None], attention_mask=mask, position_ids=next_pos[:, None], **kwargs).logits
        logits, next_pos = logits[:, -1].to(device), next_pos + 1
    wall = clock(device) - start
    for result in results:
        result.target_forwards, result.wall_s, result.target_s = len(result.tokens), wall, wall
    return results


def _coins(ops: TreeOps, trees: list[Tree], gens: Sequence[torch.Generator], device: torch.device) -> torch.Tensor:
    """Sampled verification's uniforms for B trees, each row drawn with its own generator for its own tree's shape
    (so a row uses the numbers it would use alone), zero-padded to the batch's (B, D+1, C)."""
    rows = [ops.draw_coins(tree, 1, gen, device=gen.device) for tree, gen in zip(trees, gens)]  # shapes: host trees
    if len(rows) == 1:
        return rows[0].to(device)
    coins = torch.zeros(len(rows), max(r.shape[1] for r in rows), max(r.shape[2] for r in rows), device=device)
    for b, row in enumerate(rows):
        coins[b, : row.shape[1], : row.shape[2]] = row[0]
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
    proposer: Proposer | Sequence[Proposer],
    prompts: Sequence[torch.Tensor],
    settings: DecodeSettings,
    kernels: Kernels = "reference",
    ops: TreeOps | None = None,
    seeds: Sequence[int] | None = None,
) -> list[GenerationResult]:
    """Speculative decoding of B prompts ((L_b,) ids, any lengths) together: one result per prompt.

    `proposer` drafts for the whole batch (`EagleProposer` and `MedusaProposer` draft all rows in one pass), or is a
    list of one proposer per prompt (run as `PerRow`). Each round the B trees, which must have the same node count,
    are verified in one target forward and committed into a ragged KV cache (see `TargetRunner`); rows leave the
    batch when they finish. Row b draws its samples with its own generator seeded `seeds[b]` (default
    `settings.seed + b`) and the uniforms of its own tree, so every row decodes what it decodes alone with that seed
    (greedy: plain greedy decoding of its prompt). Times (`wall_s`, `target_s`, `draft_s`) are the batch's, shared
    by its rows.
    """
    proposer = PerRow(proposer) if isinstance(proposer, (list, tuple)) else proposer
    prompts, seeds = _check_batch(prompts, seeds, settings)
    device = prompts[0].device
    gens = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    start = clock(device)
    target = TargetRunner(model, list(proposer.feature_layers), kernels, ops)
    ops = target.ops
    results = [GenerationResult(tokens=[]) for _ in prompts]
    proposer.reset(len(prompts))
    draft_s = 0.0

    try:
        logits, hidden = target.prefill(prompts)
        roots = _first_token(logits, settings, gens).tolist()
        tokens = [torch.cat([p, p.new_tensor([r])])[None] for p, r in zip(prompts, roots)]  # (1, L_b + 1) per row
        new_hidden = [None if hidden is None else hidden[b : b + 1, : p.shape[0]] for b, p in enumerate(prompts)]
        active = [b for b in range(len(prompts)) if not _finish(results[b].tokens, [roots[b]], settings)]
        if len(active) < len(prompts):
            target.keep_rows(active)
            proposer.keep_rows(active)
        while active:
            t0 = clock(device)
            trees = proposer.propose([DecodeState(tokens=tokens[b], new_hidden=new_hidden[b]) for b in active])
            draft_s += clock(device) - t0
            if len({t.num_nodes for t in trees}) != 1:
                sizes = {b: t.num_nodes for b, t in zip(active, trees)}
                raise ValueError(f"the trees of one round must have the same node count, got {sizes} (row: nodes)")
            tree = stack_trees([t.to(device) for t in trees])  # (B, N)
            logits, hidden = target.verify(tree)  # (B, N, V)
            coins = functools.partial(_coins, ops, trees, [gens[b] for b in active], device)
            accepted, nodes, bonus = _verify(ops, tree, logits, settings, coins)
            target.commit(nodes, accepted)
            node_rows, token_rows, first_child = nodes.tolist(), tree.tokens.tolist(), tree.first_child.tolist()
            paths = [row[: a + 1] for row, a in zip(node_rows, accepted)]  # node indices, root first, per row

            t0 = clock(device)
            proposer.commit(paths)
            draft_s += clock(device) - t0

            still = []
            for i, (b, path) in enumerate(zip(active, paths)):
                new = [token_rows[i][node] for node in path[1:]] + [bonus[i]]
                result = results[b]
                result.accepted.append(accepted[i])
                result.tree_depth.append(trees[i].max_depth)
                result.extendable.append(first_child[i][path[-1]] >= 0)
                result.tree_nodes.append(tree.num_nodes)
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


def _check_batch(
    prompts: Sequence[torch.Tensor], seeds: Sequence[int] | None, settings: DecodeSettings
) -> tuple[list[torch.Tensor], list[int]]:
    """Prompts as (L_b,) tensors and one seed per prompt (default settings.seed + row), or a clear error."""
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


# --------------------------------------------------------------------------------------------
# Proposers for the trained drafters


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

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """(..., d) -> (..., K) float32 logits over the draft vocabulary, on h's device."""
        logits = torch.nn.functional.linear(h.to(self.weight.device, self.weight.dtype), self.weight, self.bias)
        return logits.float().to(h.device)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Positions in the draft vocabulary -> token ids (on index's device)."""
        return self.ids.to(index.device)[index]

    def full_log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., K) draft logits -> (..., V) log-probabilities, -inf outside the draft vocabulary."""
        out = torch.full((*logits.shape[:-1], self.vocab_size), float("-inf"), device=logits.device)
        return out.index_copy_(-1, self.ids.to(logits.device), torch.log_softmax(logits, dim=-1))


def _check_draft_vocab(draft_vocab: torch.Tensor | None, top_k: int) -> None:
    if draft_vocab is not None and len(draft_vocab) < top_k:
        raise ValueError(
            f"the draft vocabulary has {len(draft_vocab)} tokens, fewer than the top {top_k} a tree drafts"
        )


class MedusaProposer:
    """Medusa heads fill a static tree: node at depth k with rank r gets head k's r-th most likely token.

    The heads read the target's last hidden state at the last cached position (the one that chose the root):
    head k predicts the token k positions after the root. Stateless: every row of a batch drafts in one pass.
    """

    feature_layers = [-1]

    def __init__(self, heads: torch.nn.Module, tree: Tree, draft_vocab: torch.Tensor | None = None):
        if tree.max_depth > heads.cfg.num_heads:
            raise ValueError(f"tree depth {tree.max_depth} exceeds the number of Medusa heads ({heads.cfg.num_heads})")
        self.heads = heads
        self.tree = tree
        self.top_k = int(tree.head_rank.max()) + 1
        self.vocab = None  # per head: its projection restricted to the draft vocabulary
        _check_draft_vocab(draft_vocab, self.top_k)
        if draft_vocab is not None:
            self.vocab = [VocabProjection(heads.projection(k), draft_vocab) for k in range(1, tree.max_depth + 1)]

    def reset(self, batch_size: int) -> None:
        pass

    def propose(self, states: Sequence[DecodeState]) -> list[Tree]:
        last = torch.cat([state.new_hidden[:, -1:, 0] for state in states])  # (B, 1, d)
        if self.vocab is None:
            logits = self.heads.head_logits(last, self.tree.max_depth)[:, :, 0]  # (D, B, V): the heads the tree reaches
            head_topk = logits.topk(self.top_k, dim=-1).indices.transpose(0, 1)  # (B, D, top_k)
        else:
            top = []
            for k, vocab in enumerate(self.vocab, 1):
                logits = vocab(self.heads.head_state(k, last[:, 0]))  # (B, K)
                top.append(vocab.token_ids(logits.topk(self.top_k, dim=-1).indices))  # (B, top_k) token ids
            head_topk = torch.stack(top, dim=1)  # (B, D, top_k)
        roots = torch.cat([state.tokens[:, -1] for state in states]).to(head_topk.device)
        tokens = medusa_tokens(self.tree, roots, head_topk)  # (B, N)
        return [dataclasses.replace(self.tree, tokens=row) for row in tokens]

    def commit(self, paths: Sequence[list[int]]) -> None:
        pass

    def keep_rows(self, rows: list[int]) -> None:
        pass


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
        draft_vocab: torch.Tensor | None = None,
    ):
        self.drafter = drafter
        self.feature_layers = list(drafter.cfg.feature_layers)
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        _check_draft_vocab(draft_vocab, top_k)
        self.vocab = None if draft_vocab is None else VocabProjection(drafter.lm_head, draft_vocab)
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
        )  # (B, 1, V or K), (B, n, d)
        if ragged:
            keep = [list(range(length)) + list(range(cached, cached + m)) for length, m in zip(self.lengths, counts)]
            width = max(len(k) for k in keep)
            self.cache.select(torch.tensor([k + [0] * (width - len(k)) for k in keep], device=device))  # packed
        self.lengths = [length + m for length, m in zip(self.lengths, counts)]
        self.committed = self.cache.length
        return logits[:, 0], (hidden[torch.arange(bsz, device=device), last] if padded else hidden[:, -1])

    def propose(self, states: Sequence[DecodeState]) -> list[Tree]:
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
                parent_hidden, tokens.to(device), pos, self.cache, tree_mask=mask, from_target=False, project=self.vocab
            )
            rows["hidden"], rows["anc"] = step_hidden, anc
            return log_probs(step_logits)  # (B, F, V)

        roots = torch.cat([state.tokens[:, -1] for state in states])
        return dynamic_trees(expand, roots, self.depth, self.top_k, self.total_tokens)

    def commit(self, paths: Sequence[list[int]]) -> None:
        self.cache.crop(self.committed)

    def keep_rows(self, rows: list[int]) -> None:
        self.cache.keep_rows(torch.tensor(rows, dtype=torch.long))
        self.lengths = [self.lengths[r] for r in rows]
        self.committed = max(self.lengths, default=0)
        self.cache.crop(self.committed)
