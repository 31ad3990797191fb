"""Recipe schema: YAML -> typed, validated dataclasses.

    recipe = load_recipe("recipes/tiny/eagle2.yaml", overrides=["train.lr=1e-3"])

A recipe has seven sections: `target`, `data`, `drafter`, `train`, `eval`, `export`, `logging`.
Every section is a dataclass below (the drafter section is the config class of the chosen method, from
`models.methods.METHODS`; loading a recipe imports no torch). Unknown keys, wrong types and impossible values
fail at load time with one line naming the key and the file (`RecipeError`); the checks that every field gets from
its annotation, and the command-line overrides, are `schema.parse`'s. This is the one module every stage imports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from models.methods import METHODS
from models.typed import build_dataclass
from rundir.lock import NotADirectory, check_output_path
from schema.parse import RecipeError, YAMLTooLarge, apply_overrides, safe_load, yaml_problem

# --------------------------------------------------------------------------------------------
# Sections


_EXPONENT_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")

# Upper bounds on sizes, checked at load time with one line naming the key. Against the target where its config is
# readable without loading it (`TargetConfig.size`): token counts (data.max_len, eval.max_new_tokens, eval tree sizes,
# eval.context_lengths) within its max_position_embeddings, vocabulary sizes (train.loss_vocab, eval.draft_vocab,
# eval.tree_top_k, eval.head_candidates, the drafter's) within its vocab_size, the drafter's layers within its
# layers (`models.configs`). And always within these, sane beyond any recipe here (10-100x the largest):
MAX_TOKENS = 1 << 20
"""Any one sequence: data.max_len, eval.max_new_tokens, each of eval.context_lengths."""
MAX_SHARD_TOKENS = 1 << 24
"""data.shard_tokens (extraction holds one shard's features in memory)."""
MAX_FORWARD_TOKENS = 1 << 20
"""data.extract_batch_tokens: padded tokens in one forward of the target."""
MAX_BATCH = 4096
"""train.batch_size and train.grad_accum (samples per micro-batch; micro-batches per step)."""
MAX_STEP_TOKENS = 1 << 24
"""train.batch_size x train.grad_accum x data.max_len: the tokens one process holds for one optimizer step (every
micro-batch of a step is read before the first backward)."""
MAX_EVAL_BATCH = 1024
"""eval.batch_size: prompts decoded together."""
MAX_TREE_DEPTH = 64
"""eval.tree_depth: draft steps per round (published trees are 4-8 deep)."""
MAX_TREE_TOKENS = 4096
"""eval.tree_total_tokens (and eval.tree_top_k): tokens one round verifies (published trees: 60-63)."""
MAX_VOCAB = 1 << 22
"""Vocabulary sizes (train.loss_vocab, eval.draft_vocab, eval.head_candidates, drafter.draft_vocab, ...)."""


def check_at_most(err, key: str, value: int, limit: int, what: str = "") -> None:
    """err(key, ...) when value > limit; `what` says what the limit is (default: this project's upper bound)."""
    if value > limit:
        err(key, f"{value} is more than {what or 'the upper bound'} ({limit})")


RANDOM_INIT_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                     "num_key_value_heads", "max_position_embeddings", "head_dim")  # fmt: skip
MAX_RANDOM_INIT_SIZE = 1 << 22
"""Each size of a randomly initialised target (`target.random_init`): weights are allocated before anything runs."""
MAX_RANDOM_INIT_PARAMETERS = 2e10
"""A randomly initialised target is built in memory whole (tests, benchmarks): 2e10 parameters is 80 GB in float32."""


def random_init_parameters(config: dict[str, Any]) -> float:
    """About how many parameters a `target.random_init` config describes (Llama-shaped: embeddings and head, attention
    and MLP per layer); 0 when its sizes are not numbers."""
    try:
        d, layers, vocab = (float(config.get(k, 0)) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
        inner = float(config.get("intermediate_size", 4 * d))
    except (TypeError, ValueError):
        return 0.0
    return 2 * vocab * d + layers * (4 * d * d + 3 * d * inner)


@dataclass
class TargetConfig:
    """The frozen target model."""

    path: str | None = None
    """HF model directory (or hub id where a hub is reachable). Exactly one of path / random_init."""
    random_init: dict[str, Any] | None = None
    """A transformers config as a dict (must contain `model_type`) for a randomly initialised target."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to `path`. Required with `random_init`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    seed: int = 0
    """Seed for `random_init` weights."""
    trust_remote_code: bool = False
    attn_implementation: str = "sdpa"
    device_map: str | dict[str, Any] | None = None
    """Spread a target too large for one GPU over several (transformers' `from_pretrained` placement, accelerate's
    hooks): `auto`, `balanced`, `sequential` over each process's equal share of the node's GPUs, or an explicit map
    of module names to a GPU index, `cpu` or `disk` (with `offload_folder`). Used by evaluation, extraction and
    online training (`models.target.load_placed_target`); by default the target is whole on each process's device."""
    offload_folder: str | None = None
    """Where a `device_map`'s `disk` entries keep weights that are not in the checkpoint's safetensors already."""

    def validate(self, err) -> None:
        if self.seed < 0:
            err("target.seed", f"must be >= 0, got {self.seed}")
        if (self.path is None) == (self.random_init is None):
            err("target", "set exactly one of target.path and target.random_init")
        if self.device_map is not None and self.path is None:
            err("target.device_map", "needs target.path (a randomly initialised target is built on one device)")
        if isinstance(self.device_map, dict) and "disk" in self.device_map.values() and self.offload_folder is None:
            err("target.offload_folder", "is required when target.device_map places modules on disk")
        if self.random_init is not None:
            for key, value in self.random_init.items():  # YAML 1.1 reads `1e-5` (no dot) as a string
                if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value):
                    self.random_init[key] = float(value)
            if "model_type" not in self.random_init:
                err("target.random_init", "needs a model_type (e.g. llama, qwen2, mistral)")
            for key in RANDOM_INIT_SIZES:
                value = self.random_init.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_RANDOM_INIT_SIZE:
                    err(f"target.random_init.{key}", f"{value} is more than the upper bound ({MAX_RANDOM_INIT_SIZE})")
            if (params := random_init_parameters(self.random_init)) > MAX_RANDOM_INIT_PARAMETERS:
                err(
                    "target.random_init",
                    f"describes a target of about {params:.3g} parameters, more than the upper bound for a randomly "
                    f"initialised one ({MAX_RANDOM_INIT_PARAMETERS:.0e}); load a real target with target.path",
                )
            if self.tokenizer is None:
                err("target.tokenizer", "is required when target.random_init is used")

    @property
    def num_layers(self) -> int | None:
        """Number of decoder layers when known without loading the model (random_init, or a local directory's
        config.json); else None."""
        return self.size("num_hidden_layers")

    def size(self, key: str) -> int | None:
        """A positive integer field of the target's transformers config (`num_hidden_layers`, `vocab_size`,
        `max_position_embeddings`, `hidden_size`) when known without loading the model: from `random_init`, or a
        local directory's config.json (a multimodal config's `text_config` too); else None."""
        if self.random_init is not None:
            config: Any = self.random_init
        else:
            path = Path(self.path) / "config.json" if self.path else None
            if path is None or not path.is_file():
                return None
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError, UnicodeDecodeError):
                return None  # loading the target reports an unreadable config with its own message
        if not isinstance(config, dict):
            return None
        value = config.get(key)
        if value is None and isinstance(config.get("text_config"), dict):
            value = config["text_config"].get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass
class DataConfig:
    """Conversations in, token data and feature shards out."""

    train_files: list[str] = field(default_factory=list)
    """JSONL files: ShareGPT (`conversations`), OpenAI (`messages`) or plain (`prompt` + `completion`, and the
    target's own `completion_ids` when data.selfdistill wrote them)."""
    hf_dataset: str | None = None
    """Alternatively a `datasets` source (name or local path), with hf_split."""
    hf_split: str = "train"
    format: Literal["auto", "sharegpt", "openai", "plain"] = "auto"
    max_len: int = 2048
    skip_malformed: bool = False
    """Skip (and count) malformed records instead of failing on the first one."""
    max_samples: int | None = None
    layers: list[int] = field(default_factory=lambda: [-1])
    """Hidden-state indices to store (HF convention: 0 = embeddings, i = layer i output, -1 = final norm)."""
    features_dir: str | None = None
    """Feature shard directory (written by `data.extract`, read by offline training)."""
    storage_dtype: Literal["bfloat16", "float16", "float32", "fp8_e4m3", "pca"] = "bfloat16"
    """How shards store hidden states (`data/codecs.py`): bfloat16 (2 bytes a value), float16, float32, or encoded,
    which readers decode to float32 (on the training device): fp8_e4m3 (1 byte a value + a float32 scale per token
    and layer: about 0.5x bf16, ~2.6% relative RMS error) or pca (per-layer principal axes fitted on the data, stored
    once beside the shards, then `storage_bits` bits a value: 0.24x bf16 at 3.8 bits)."""
    storage_bits: float | list[float] = 3.8
    """pca: bits per stored value, its per-token scale included: one for every stored layer, or one per entry of
    `data.layers` (e.g. more for -1, which EAGLE training also reads as its target)."""
    storage_fit_tokens: int = 32768
    """pca: tokens whose hidden states the bases are fitted on (samples spread evenly over the data; one extra forward
    over them, held as float32 on the host while fitting)."""
    shard_tokens: int = 1 << 20
    """Tokens per shard (a shard closes at the first sample boundary past this)."""
    extract_batch_tokens: int = 8192
    """Tokens per extraction forward. It decides the batches, whose shape moves features in their last bits: a resumed
    extraction equals an uninterrupted one byte for byte only with the same value (a resume does not check it)."""
    heldout_fraction: float = 0.02
    verify_checksums: bool = True
    """Check each feature shard's sha256 against the manifest whenever extraction reuses it (a bad one is extracted
    again) and whenever training, evaluation or export open the features (a bad one is refused, naming it and what
    to do): each shard is hashed once, at open (about 1.8 GB/s per process). `false` skips the hashing (sizes are
    still checked), e.g. to save start-up time on very large feature sets that are known good."""

    def validate(self, err) -> None:
        if not self.train_files and self.hf_dataset is None:
            err("data.train_files", "no dataset: set data.train_files or data.hf_dataset")
        if self.max_len < 2:
            err("data.max_len", f"must be >= 2, got {self.max_len}")
        if not self.layers:
            err("data.layers", "must list at least one hidden-state index")
        if len(set(self.layers)) != len(self.layers):
            err("data.layers", f"has duplicates: {self.layers}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            err("data.heldout_fraction", f"must be in [0, 1), got {self.heldout_fraction}")
        if self.max_samples is not None and self.max_samples < 1:
            err("data.max_samples", f"must be >= 1 or null (every record), got {self.max_samples}")
        bits = self.storage_bits if isinstance(self.storage_bits, list) else [self.storage_bits]
        if isinstance(self.storage_bits, list) and len(bits) != len(self.layers):
            err("data.storage_bits", f"lists {len(bits)} values for {len(self.layers)} data.layers")
        if not all(1.0 <= b <= 8.0 for b in bits):
            err("data.storage_bits", f"must be within [1, 8] bits per value, got {self.storage_bits}")
        for key in ("shard_tokens", "extract_batch_tokens", "storage_fit_tokens"):
            if getattr(self, key) < 1:
                err(f"data.{key}", f"must be >= 1, got {getattr(self, key)}")
        check_at_most(err, "data.max_len", self.max_len, MAX_TOKENS)
        check_at_most(err, "data.shard_tokens", self.shard_tokens, MAX_SHARD_TOKENS)
        check_at_most(err, "data.extract_batch_tokens", self.extract_batch_tokens, MAX_FORWARD_TOKENS)


@dataclass
class TrainConfig:
    """The one training loop (train/loop.py)."""

    output_dir: str = "runs/default"
    online: bool = False
    """Run the target inside the step on token data instead of reading feature shards."""
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 0
    max_steps: int = 100
    batch_size: int = 8
    """Samples per micro-batch per process."""
    grad_accum: int = 1
    clip_grad_norm: float | None = 1.0
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    packing: bool = False
    eval_every: int = 0
    """Held-out evaluation every N optimizer steps (0 = only at the end)."""
    eval_batches: int = 8
    """Each held-out evaluation scores eval_batches x batch_size held-out samples (the whole split when it is smaller),
    drawn once with `seed`: the same samples however many processes share them."""
    save_every: int = 0
    """Checkpoint every N optimizer steps (0 = only at the end)."""
    keep_checkpoints: int = 2
    log_every: int = 10
    loss_vocab: int = 0
    """Compute the training losses over the N most frequent loss tokens of the feature shards only (0 = the whole
    vocabulary). On a large vocabulary the lm_head projections dominate a drafter's step; EAGLE's soft CE is then
    taken over that subset (target distribution renormalised on it), Medusa's CE skips positions whose label is
    outside it. The exported drafter is unchanged: it drafts with the target's full lm_head (or `eval.draft_vocab`)."""
    first_records: int | None = None
    """Train only on the training split's samples among the first N records of the data (`data.train_files` in
    order, or the HF dataset): one feature set then serves a curve of data sizes. The held-out split stays that of
    the whole data, and the draft vocabulary is counted on the samples trained on. null: every training sample."""
    head_lr_mult: float = 1.0
    """Learning-rate multiplier for parameters the drafter marks as heads: Medusa-2's heads against its LoRA
    adapters (4 in its recipes), EAGLE-3's own LM head (which starts from the target's rows). Every Medusa-1
    parameter is a head, so there it only rescales `train.lr` (its recipes keep 1)."""
    resume: str | None = None
    """`auto` = continue from the newest checkpoint in output_dir (if any); or a checkpoint directory."""

    def validate(self, err) -> None:
        for key in ("max_steps", "batch_size", "grad_accum", "log_every", "keep_checkpoints", "eval_batches"):
            if getattr(self, key) < 1:
                err(f"train.{key}", f"must be >= 1, got {getattr(self, key)}")
        for key in ("save_every", "eval_every", "seed"):
            if getattr(self, key) < 0:
                err(f"train.{key}", f"must be >= 0, got {getattr(self, key)}")
        if self.lr <= 0:
            err("train.lr", f"must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            err("train.weight_decay", f"must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            err("train.betas", f"must be two numbers in [0, 1), got {self.betas}")
        if self.warmup_steps < 0 or self.warmup_steps > self.max_steps:
            err("train.warmup_steps", f"must be in [0, max_steps={self.max_steps}], got {self.warmup_steps}")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            err("train.clip_grad_norm", f"must be > 0 or null, got {self.clip_grad_norm}")
        if self.head_lr_mult <= 0:
            err("train.head_lr_mult", f"must be > 0, got {self.head_lr_mult}")
        if self.first_records is not None and self.first_records < 1:
            err("train.first_records", f"must be >= 1 or null (every record), got {self.first_records}")
        if self.loss_vocab < 0:
            err("train.loss_vocab", f"must be 0 (the whole vocabulary) or a token count, got {self.loss_vocab}")
        if self.loss_vocab and self.online:
            err("train.loss_vocab", "counts tokens in the feature shards: offline training only (train.online=false)")
        check_at_most(err, "train.batch_size", self.batch_size, MAX_BATCH)
        check_at_most(err, "train.grad_accum", self.grad_accum, MAX_BATCH)
        check_at_most(err, "train.loss_vocab", self.loss_vocab, MAX_VOCAB)


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
    tree, `calibrated63` this project's 63-node tree (`models/named_trees.py`); `cost` = a tree whose size each round
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


@dataclass
class ExportConfig:
    format: Literal["native", "eagle", "sglang", "medusa", "vllm", "speculators"] = "native"
    """Engine layouts (export/write.py; EAGLE-3: export/eagle3_layouts.py). `speculators` holds `eagle3` drafters only:
    its layer attends over [embedding | fused features], which specdraft's EAGLE-2 drafter is not."""
    out: str | None = None
    """Where the recipe's own `format` goes; defaults to <train.output_dir>/export (native) or
    <train.output_dir>/export-<format> (engine layouts)."""
    include_target_weights: bool = False
    """Copy frozen target tensors into the export: `native` gets the embeddings and lm_head, the EAGLE-1/2 layouts
    (`eagle`, `sglang`, `vllm`) the embedding; Medusa layouts are unchanged, and the EAGLE-3 `speculators` layout
    (also what `vllm` writes for EAGLE-3) always carries the embedding."""
    merge_lora: bool = False
    """Drafters with LoRA adapters (Medusa-2): also write the target with the adapters merged in (`merged/`)."""

    def validate(self, err) -> None:
        """Nothing beyond the fields' types (whether `format` holds the drafter: `export.write` checks)."""


@dataclass
class LoggingConfig:
    tracker: Literal["none", "wandb", "tensorboard"] = "none"
    project: str = "specdraft"
    run_name: str | None = None

    def validate(self, err) -> None:
        """Nothing beyond the fields' types."""


@dataclass
class Recipe:
    target: TargetConfig
    data: DataConfig
    drafter: Any
    """The method's config dataclass (`models.methods.METHODS[method].config`); has a `method` field."""
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    source: str = "<memory>"
    """File the recipe was loaded from (not a YAML key)."""
    overrides: tuple[str, ...] = ()
    """The `section.key=value` overrides it was loaded with (not a YAML key)."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source")
        out.pop("overrides")
        return out

    def command(self, module: str) -> str:
        """`python -m MODULE` on this recipe as it was loaded (file and overrides), for hints a user can paste."""
        return " ".join(["python -m", module, *(shlex.quote(arg) for arg in (self.source, *self.overrides))])

    def save(self, path: str | Path) -> None:
        """Write the resolved recipe (YAML) next to an output."""
        Path(path).write_text(f"# resolved from {self.source}\n" + yaml.safe_dump(self.to_dict(), sort_keys=False))

    def section_hash(self, *sections: str) -> str:
        """Stable hash of some sections, used to refuse reusing outputs built from other settings."""
        chosen = {s: self.to_dict()[s] for s in sections}
        if "data" in chosen:  # a check, not a setting: hashed as its former default, so older checkpoints still match
            chosen["data"]["verify_checksums"] = False
            if chosen["data"]["storage_dtype"] != "pca":  # pca's settings mean nothing to other dtypes: unhashed
                chosen["data"].pop("storage_bits")
                chosen["data"].pop("storage_fit_tokens")
        blob = json.dumps(chosen, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def dotted_settings(recipe: dict[str, Any], sections: typing.Iterable[str]) -> dict[str, Any]:
    """A recipe mapping's `sections` as flat `section.key` -> value (nested mappings walked, lists kept whole), in
    the recipe's order: what refusals compare to name the first setting that differs."""
    flat: dict[str, Any] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        else:
            flat[key] = value

    for section in sections:
        walk(recipe.get(section) or {}, section)
    return flat


SECTIONS: dict[str, type] = {
    "target": TargetConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "export": ExportConfig,
    "logging": LoggingConfig,
}


# --------------------------------------------------------------------------------------------
# Loading


def recipe_from_dict(raw: dict, source: str = "<memory>") -> Recipe:
    """Validate a raw mapping into a Recipe; errors name `source` and the key."""

    def err(key: str, msg: str) -> typing.NoReturn:
        raise RecipeError(f"{source}: {key}: {msg}")

    if not isinstance(raw, dict):
        err("<top>", "a recipe must be a mapping of sections")
    unknown = sorted(set(raw) - set(SECTIONS) - {"drafter"})
    if unknown:
        err(unknown[0], f"unknown section (known: drafter, {', '.join(SECTIONS)})")
    for required in ("target", "data", "drafter"):
        if required not in raw:
            err(required, "section is required")
    sections = {name: build_dataclass(cls, raw.get(name), name, err) for name, cls in SECTIONS.items()}
    drafter_raw = raw["drafter"]
    if not isinstance(drafter_raw, dict) or "method" not in drafter_raw:
        err("drafter.method", f"is required (one of {sorted(METHODS)})")
    method = drafter_raw["method"]
    if method not in METHODS:
        err("drafter.method", f"unknown method {method!r} (known: {sorted(METHODS)})")
    drafter = build_dataclass(METHODS[method].config, drafter_raw, "drafter", err)
    recipe = Recipe(drafter=drafter, source=source, **sections)
    _check_cross_section(recipe, err)
    return recipe


def _check_sizes(recipe: Recipe, err) -> None:
    """Sizes that span sections or depend on the target: the tokens one training step holds, and token counts and
    vocabulary sizes within the target's max_position_embeddings and vocab_size (when its config is readable)."""
    train, data, ev = recipe.train, recipe.data, recipe.eval
    if train.batch_size * train.grad_accum * data.max_len > MAX_STEP_TOKENS:
        err(
            "train.batch_size",
            f"train.batch_size x train.grad_accum x data.max_len = {train.batch_size} x {train.grad_accum} x "
            f"{data.max_len} tokens per process and step, more than the upper bound ({MAX_STEP_TOKENS})",
        )
    positions = recipe.target.size("max_position_embeddings")
    if positions is not None:
        what = "the target's max_position_embeddings"
        check_at_most(err, "data.max_len", data.max_len, positions, what)
        check_at_most(err, "eval.max_new_tokens", ev.max_new_tokens, positions, what)
        check_at_most(err, "eval.tree_total_tokens", ev.tree_total_tokens, positions, what)
        for i, n in enumerate(ev.context_lengths):
            check_at_most(err, f"eval.context_lengths[{i}]", n, positions, what)
    vocab = recipe.target.size("vocab_size")
    if vocab is not None:
        what = "the target's vocab_size"
        check_at_most(err, "train.loss_vocab", train.loss_vocab, vocab, what)
        for key in ("draft_vocab", "tree_top_k", "head_candidates"):
            check_at_most(err, f"eval.{key}", getattr(ev, key), vocab, what)
    hidden = recipe.target.size("hidden_size")
    if hidden is not None and ev.head == "two_stage":
        check_at_most(err, "eval.head_rank", ev.head_rank, hidden, "the target's hidden_size")


def _check_cross_section(recipe: Recipe, err) -> None:
    """Constraints that span sections: sizes (`_check_sizes`), layers in range, drafter needs vs stored features,
    what the method declares (`models.methods`: the trees it drafts, online-only training), then the method's own
    limits."""
    _check_sizes(recipe, err)
    n_layers = recipe.target.num_layers
    if n_layers is not None:
        for i, layer in enumerate(recipe.data.layers):
            if not -1 <= layer <= n_layers:
                err(f"data.layers[{i}]", f"layer {layer} out of range for a {n_layers}-layer target (-1..{n_layers})")
    method = METHODS[recipe.drafter.method]
    # offline, the shards hold data.layers; online, the training step computes exactly those (methods that run the
    # target themselves, e.g. Medusa-2, take what they need)
    for layer in recipe.drafter.feature_layers:
        if layer not in recipe.data.layers and not method.online_only:
            err("drafter.feature_layers", f"layer {layer} is not stored in data.layers={recipe.data.layers}")
    if recipe.eval.tree not in method.trees:
        err("eval.tree", f"{recipe.eval.tree}: a {method.name} drafter drafts {', '.join(method.trees)} trees")
    if method.online_only and not recipe.train.online:
        err("train.online", f"{method.name} runs the target inside its training step: set train.online: true")
    recipe.drafter.check_recipe(recipe, err)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""What a hub id looks like (`name` or `org/name`): a path of another shape that does not exist is a typo."""


def _check_model_dir(path: str, key: str, err, config: bool) -> None:
    p = Path(path)
    if p.is_dir():
        if config and not (p / "config.json").is_file():
            err(key, f"{path} is not a Hugging Face model directory (no config.json)")
        return
    if p.exists():
        err(key, f"{path} is a file, not a model directory")
    parent = p.parent
    if not _HUB_ID.fullmatch(path) or ".." in path or (parent != Path(".") and parent.is_dir()):
        err(key, f"no such directory {path}")  # `runs/x` with a local `runs/`: a typo, not the hub's org `runs`


def check_inputs(recipe: Recipe, keys: typing.Iterable[str]) -> None:
    """Refuse missing inputs of the keys a stage reads before any heavy work (RecipeError naming the key and the
    file). Keys: `target.path`, `target.tokenizer` (local directories; a name shaped like a hub id is left to the
    hub), `data.train_files`, `eval.prompts`, `drafter` (the method's own inputs, its config's `check_inputs`), and
    the output directories `train.output_dir`, `data.features_dir` (refused when they are, or lie under, a file)."""

    def err(key: str, msg: str) -> typing.NoReturn:
        raise RecipeError(f"{recipe.source}: {key}: {msg}")

    for key in keys:
        if key == "target.path" and recipe.target.path is not None:
            _check_model_dir(recipe.target.path, key, err, config=True)
        elif key == "target.tokenizer" and recipe.target.tokenizer is not None:
            _check_model_dir(recipe.target.tokenizer, key, err, config=False)
        elif key == "data.train_files":
            for i, file in enumerate(recipe.data.train_files):
                if not Path(file).is_file():
                    err(f"data.train_files[{i}]", f"no such file {file}")
        elif key == "eval.prompts":
            if recipe.eval.prompts is None:
                err(key, "is required (a JSONL file of prompts)")
            if not Path(recipe.eval.prompts).is_file():
                err(key, f"no such file {recipe.eval.prompts}")
        elif key == "drafter":
            recipe.drafter.check_inputs(err)
        elif key in ("train.output_dir", "data.features_dir"):  # outputs: a directory to create or reuse
            value = recipe.train.output_dir if key == "train.output_dir" else recipe.data.features_dir
            if value is not None:
                try:
                    check_output_path(value, key)
                except NotADirectory as exc:
                    raise RecipeError(f"{recipe.source}: {exc}") from None


def load_recipe(path: str | Path, overrides: list[str] | None = None, inputs: typing.Iterable[str] = ()) -> Recipe:
    """Load, override and validate a YAML recipe; then check the input files of `inputs` (see `check_inputs`)."""
    path = Path(path)
    source = str(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.yaml"))
        raise RecipeError(
            f"{source}: a directory, not a recipe file" + (f" (it holds {', '.join(found)})" if found else "")
        )
    if not path.is_file():
        raise RecipeError(f"{source}: no such recipe file")
    try:
        raw = safe_load(path.read_text(encoding="utf-8")) or {}
    except YAMLTooLarge as exc:
        raise RecipeError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise RecipeError(f"{source}: not valid YAML: {yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        raise RecipeError(f"{source}: not UTF-8 text (byte {byte:#04x} at offset {exc.start})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{source}: <top>: a recipe must be a mapping of sections, got {type(raw).__name__}")
    recipe = recipe_from_dict(apply_overrides(raw, overrides or [], source), source)
    recipe.overrides = tuple(overrides or ())
    check_inputs(recipe, inputs)
    return recipe
