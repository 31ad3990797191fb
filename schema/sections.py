"""The recipe's sections other than `eval` and `drafter`: `target`, `data`, `train`, `export`, `logging`, and the
upper bounds every size is checked against at load time. `schema.recipe` assembles them into a recipe."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from methods import FORMATS

_EXPONENT_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


# Upper bounds on sizes, checked at load time with one line naming the key. Against the target where its config is
# readable without loading it (`TargetConfig.size`): token counts (data.max_len, eval.max_new_tokens, eval tree sizes,
# eval.context_lengths) within its max_position_embeddings, vocabulary sizes (train.loss_vocab, eval.draft_vocab,
# eval.tree_top_k, eval.head_candidates, the drafter's) within its vocab_size, the drafter's layers within its
# layers (`methods.limits`). And always within these, sane beyond any recipe here (10-100x the largest):
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
    """Read only the first N usable samples (null: every record)."""
    max_loss_tokens: int | None = None
    """Stop reading once the samples hold this many loss tokens, counted after truncation to `max_len` and
    `max_repeat_run` (the sample that reaches it is kept): two data sources compared at equal training tokens."""
    max_repeat_run: int | None = None
    """Loops out of the loss: of each run of consecutive answer tokens that repeat earlier answer text (the 8 tokens
    ending at it seen before), keep the first N in the loss (a sample that ends in such a run is cut after them). A
    small target's greedy answers often end in a loop; null: every token counts."""
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
        if self.max_loss_tokens is not None and self.max_loss_tokens < 1:
            err("data.max_loss_tokens", f"must be >= 1 or null (every record), got {self.max_loss_tokens}")
        if self.max_repeat_run is not None and self.max_repeat_run < 0:
            err("data.max_repeat_run", f"must be >= 0 or null (every token counts), got {self.max_repeat_run}")
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
class ExportConfig:
    format: str = "native"
    """`native`, or an engine layout that some method declares (`methods`: native, eagle, sglang, medusa, vllm,
    speculators); whether it holds the recipe's drafter is the method's `formats` (`speculators` holds `eagle3`,
    `peagle` and `dflash` drafters, not EAGLE-2's, whose layer does not attend over [embedding | fused features])."""
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
        """`format` is one some method declares (whether it holds this recipe's drafter: `export.write` checks)."""
        if self.format not in FORMATS:
            err("export.format", f"must be one of {', '.join(FORMATS)}, got {self.format!r}")


@dataclass
class LoggingConfig:
    tracker: Literal["none", "wandb", "tensorboard"] = "none"
    project: str = "specdraft"
    run_name: str | None = None

    def validate(self, err) -> None:
        """Nothing beyond the fields' types."""
