"""The recipe's `eval` section (and the sampling settings it shares with plain decoding): trees, kernels, sampling,
baselines and the prompts; checked field by field at load time like every section (`schema.recipe`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from schema.sections import (
    MAX_EVAL_BATCH,
    MAX_TOKENS,
    MAX_TREE_DEPTH,
    MAX_TREE_TOKENS,
    MAX_VOCAB,
    check_at_most,
)


@dataclass
class SamplingConfig:
    """How the target decodes: the fields `eval` recipes and `eval.decode.DecodeSettings` share."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    acceptance: Literal["exact", "typical"] = "exact"
    """`exact`: greedy / lossless rejection sampling; `typical`: Medusa typical acceptance (lossy)."""
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3


@dataclass
class EvalConfig(SamplingConfig):
    """Acceptance-length evaluation (`python -m eval`); the decoding fields come from `SamplingConfig`."""

    drafter: str | None = None
    """Exported drafter directory (export.write output); defaults to `export.out`, else <train.output_dir>/export,
    which must then be of the run's newest checkpoint (exports record their step): a run that trained on since is
    refused until re-exported. A directory named here is evaluated as it is."""
    prompts: str | None = None
    """JSONL prompts (chat or plain)."""
    output_dir: str | None = None
    max_prompts: int | None = None
    tree: Literal["auto", "chain", "mc_sim_7b_63", "calibrated63", "calibrated", "dynamic", "cost"] = "auto"
    """Tree shape; `auto` = EAGLE's dynamic tree or Medusa's calibrated one; `mc_sim_7b_63` is Medusa's published
    tree, `calibrated63` this project's 63-node tree (`methods/named_trees.py`); `cost` = a tree whose size each round
    maximises expected tokens per second under verify / draft costs measured at start-up (`eval/cost_trees.py`), at
    most `tree_total_tokens`: EAGLE's dynamic tree, or for Medusa and P-EAGLE the most probable of every rank path
    `tree_top_k` wide and `tree_depth` deep."""
    tree_depth: int = 5
    """Drafted levels (dynamic trees, chains): the most draft tokens a round can accept. EAGLE's reference code
    drafts one level more than its `depth` (its depth 5 is 6 here)."""
    tree_top_k: int = 10
    tree_total_tokens: int = 60
    """Tokens a round verifies, the root (the last accepted token) included, so tree_total_tokens - 1 are drafted.
    EAGLE's reference code drafts `total_token` tokens beside the root (its 60 is 61 here)."""
    draft_vocab: int = 0
    """0: draft over the whole vocabulary. N > 0: draft only among the N most frequent loss tokens of
    `data.features_dir` (an EAGLE-3-style draft vocabulary: each draft step's vocabulary projection costs N/V
    as much; verification still uses the full vocabulary, so outputs are unchanged). An EAGLE-3 drafter keeps those
    N rows of its own head (N at most its `drafter.draft_vocab`)."""
    head: Literal["full", "two_stage"] = "full"
    """The draft steps' vocabulary projections: `full` (or the `draft_vocab` rows), or `two_stage`: for each of the
    drafter's heads (EAGLE-2: the target's lm_head; EAGLE-3: its own over the draft vocabulary; Medusa: every head),
    a rank-`head_rank` screen of all its rows keeps `head_candidates` tokens, whose exact logits follow
    (`eval/heads.py`, screening through `eval.kernels`: the Triton kernel or its twin; the factors, `models/lm_head.py`,
    come with the export, else are fitted at start-up)."""
    head_rank: int = 64
    head_candidates: int = 256
    tie_margin: float | None = None
    """Greedy losslessness on a bf16 / fp16 target: a first differing token still counts as lossless when it and
    plain decoding's token both have float32-target logits within this many logits of the best one, or when the
    target's own cache-free forward picks the speculative token (a rounding tie; counted in the report; see
    eval.checks.near_tie). None = 0 for float32 targets, 0.5 for bf16 / fp16."""
    kernels: Literal["triton", "reference"] = "triton"
    baselines: list[str] = field(default_factory=lambda: ["plain", "prompt_lookup"])
    batch_size: int = 1
    """Prompts decoded together (one target forward verifies every row's tree; the plain baseline decodes the same
    batches). Speeds are then batch throughputs. Prompt lookup decodes one prompt at a time: with batch_size > 1,
    `baselines` must leave it out."""
    seed: int = 0
    context_lengths: list[int] = field(default_factory=list)
    """Also measure τ at long context: every prompt is decoded once per length here, preceded by whole conversations
    from `context_source` (as many as fit) so that its input reaches at most that many tokens; 0 = the prompt alone.
    The report gives τ per length (a table and a plot), e.g. [0, 1024, 2048, 4096]; chat prompts only."""
    draft_window: int | None = None
    """EAGLE drafters attend to fewer than this many positions back while drafting; None: the longest sequence the
    drafter trained on (`data.max_len` of the recipe its export records), so that it never meets a distance it did
    not train on, however long the context (SmolLM2 EAGLE-3.1 at 4k tokens: τ 3.42 windowed at 384, 2.95 without);
    0: the whole context. Serving engines do not apply it: they run the drafter over the whole context."""
    lookup_tokens: int = 0
    """0: off. N > 0: each round, the tokens that followed the most recent earlier occurrence of the row's last
    `lookup_ngram` (down to 1) tokens, at most N of them, join the drafter's tree as a branch (prompt lookup inside
    the tree, `eval/lookup.py`), scored by their measured acceptance against the drafter's own path probabilities for
    the tree's places (with `tree: cost`, the size is chosen again on both). Lossless: outputs are unchanged."""
    lookup_ngram: int = 3
    context_source: str | None = None
    """JSONL conversations that precede the prompts under `context_lengths`: chat records with assistant turns, or
    {prompt, completion} records (e.g. data.selfdistill's answers to prompts the drafter never trained on)."""

    def validate(self, err) -> None:
        if self.max_new_tokens < 1:
            err("eval.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            err("eval.temperature", f"must be >= 0, got {self.temperature}")
        if self.max_prompts is not None and self.max_prompts < 1:
            err("eval.max_prompts", f"must be >= 1 or null (every prompt), got {self.max_prompts}")
        for key in ("typical_epsilon", "typical_delta"):
            if getattr(self, key) <= 0:
                err(f"eval.{key}", f"must be > 0, got {getattr(self, key)}")
        if not 0 < self.top_p <= 1:
            err("eval.top_p", f"must be in (0, 1], got {self.top_p}")
        for key, least in (("tree_depth", 1), ("tree_top_k", 1), ("tree_total_tokens", 2)):
            if getattr(self, key) < least:
                err(f"eval.{key}", f"must be >= {least}, got {getattr(self, key)}")
        if self.head == "two_stage":
            if self.draft_vocab:
                err("eval.head", "two_stage screens every row of the heads: set eval.draft_vocab to 0")
            if self.head_rank < 1 or self.head_candidates < self.tree_top_k:
                err("eval.head_candidates", f"must be >= tree_top_k with head_rank >= 1, got {self.head_candidates}, "
                    f"{self.head_rank}")  # fmt: skip
        if self.draft_vocab < 0 or 0 < self.draft_vocab < self.tree_top_k:
            err("eval.draft_vocab", f"must be 0 (the whole vocabulary) or >= tree_top_k, got {self.draft_vocab}")
        unknown = [b for b in self.baselines if b not in EVAL_BASELINES]
        if unknown:
            err("eval.baselines", f"unknown {unknown}; available: {list(EVAL_BASELINES)}")
        if self.batch_size < 1:
            err("eval.batch_size", f"must be >= 1, got {self.batch_size}")
        if self.seed < 0:
            err("eval.seed", f"must be >= 0, got {self.seed}")
        if self.batch_size > 1 and "prompt_lookup" in self.baselines:
            err(
                "eval.batch_size",
                "prompt lookup (transformers' assisted decoding) decodes one prompt at a time; with batch_size > 1 "
                "leave it out of the baselines (eval.baselines=[plain] on the command line)",
            )
        if self.tie_margin is not None and not 0 <= self.tie_margin < float("inf"):
            err("eval.tie_margin", f"must be a finite number >= 0, got {self.tie_margin}")
        if self.draft_window is not None and self.draft_window < 0:
            err(
                "eval.draft_window",
                f"must be >= 1 (positions), 0 (the whole context) or null (auto), got {self.draft_window}",
            )
        if any(not isinstance(n, int) or n < 0 for n in self.context_lengths):
            err("eval.context_lengths", f"must be token counts >= 0 (0: the prompt alone), got {self.context_lengths}")
        elif len(set(self.context_lengths)) < len(self.context_lengths):
            err("eval.context_lengths", f"lists a length twice: {self.context_lengths}")
        if any(self.context_lengths) and self.context_source is None:
            err(
                "eval.context_source",
                "is required with eval.context_lengths above 0 (the conversations before a prompt)",
            )
        if self.acceptance == "typical" and self.temperature == 0:
            err("eval.acceptance", "typical acceptance needs temperature > 0 (greedy is already exact)")
        check_at_most(err, "eval.max_new_tokens", self.max_new_tokens, MAX_TOKENS)
        for i, n in enumerate(self.context_lengths):
            check_at_most(err, f"eval.context_lengths[{i}]", n, MAX_TOKENS)
        check_at_most(err, "eval.tree_depth", self.tree_depth, MAX_TREE_DEPTH)
        check_at_most(err, "eval.tree_top_k", self.tree_top_k, MAX_TREE_TOKENS)
        check_at_most(err, "eval.tree_total_tokens", self.tree_total_tokens, MAX_TREE_TOKENS)
        check_at_most(err, "eval.batch_size", self.batch_size, MAX_EVAL_BATCH)
        if self.lookup_tokens < 0:
            err("eval.lookup_tokens", f"must be >= 0 (0: no prompt lookup in the tree), got {self.lookup_tokens}")
        if self.lookup_ngram < 1:
            err("eval.lookup_ngram", f"must be >= 1, got {self.lookup_ngram}")
        check_at_most(err, "eval.lookup_tokens", self.lookup_tokens, MAX_TREE_TOKENS)
        check_at_most(err, "eval.lookup_ngram", self.lookup_ngram, MAX_TREE_TOKENS)
        for key in ("draft_vocab", "head_rank", "head_candidates"):
            check_at_most(err, f"eval.{key}", getattr(self, key), MAX_VOCAB)


EVAL_BASELINES = ("plain", "prompt_lookup")
