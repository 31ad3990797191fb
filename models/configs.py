"""Drafter method configurations (recipe section `drafter`): plain dataclasses, no torch.

The recipe schema (`schema.recipe`) reads these to load and check a recipe, so loading one imports neither
torch, transformers nor peft. Each config validates its own fields (`validate`), its recipe context
(`check_recipe`: the method-specific limits on trees, vocabularies, online training) and, before a run, its
input files (`check_inputs`). It also declares, so that no caller probes it: which of its fields the target's sizes
bound (`target_sized`), whether its drafter borrows the target's lm_head (`borrows_lm_head`), and itself without its
input files (`without_inputs`: what rebuilds a drafter whose tensors a checkpoint holds). Which tree shapes a method
drafts at all is declared once, in `models.methods`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from models import named_trees

DraftLoss = Literal["kl", "hass", "tv", "nla", "lk_hybrid"]
"""The objectives of drafters with their own head (models/losses.py)."""

LLAMA_LINEAR_LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Upper bounds on the drafter's sizes, checked at load time (the recipe schema's other bounds: `schema.recipe`). Always
# these; and against the target where its config is readable without loading it (`TargetConfig.size`): layers
# within its num_hidden_layers, vocabularies within its vocab_size, LoRA rank within its hidden_size.
MAX_LAYERS = 64
"""drafter.num_layers (EAGLE decoder layers; Medusa residual blocks per head)."""
MAX_HEADS = 64
"""drafter.num_heads (Medusa; the papers use 3-5)."""
MAX_TTT_STEPS = 64
"""drafter.ttt_steps (EAGLE-3 unrolled steps; the paper uses 7)."""
MAX_VOCAB = 1 << 22
"""drafter.draft_vocab, drafter.topk_metric."""
MAX_RANK = 1 << 16
"""drafter.lora_r (Medusa-2's adapters; its recipes use 32)."""


def at_most(err, key: str, value: int, limit: int | None, what: str = "the upper bound") -> None:
    """err(key, ...) when `limit` is known and value > limit."""
    if limit is not None and value > limit:
        err(key, f"{value} is more than {what} ({limit})")


TARGET_SIZES = {
    "num_layers": "num_hidden_layers",
    "draft_vocab": "vocab_size",
    "topk_metric": "vocab_size",
    "lora_r": "hidden_size",
}
"""Drafter fields a size of the target bounds -> that size (a field of the target's transformers config)."""


def check_target_sizes(sized: dict[str, int], recipe, err) -> None:
    """A drafter's layers within the target's (a drafter deeper than its target is never what was meant), its
    vocabularies within the target's vocabulary, its LoRA rank within the hidden size: `sized` is what a config
    declares (`target_sized()`: {field: value}, each a key of `TARGET_SIZES`), checked in its order."""
    for key, value in sized.items():
        size = TARGET_SIZES[key]
        at_most(err, f"drafter.{key}", value, recipe.target.size(size), f"the target's {size}")


@dataclass
class EagleConfig:
    """EAGLE-2 drafter (recipe section `drafter`, `method: eagle2`)."""

    method: Literal["eagle2"] = "eagle2"
    feature_layers: list[int] = field(default_factory=lambda: [-1])
    """Target hidden-state indices fed to the drafter: [-1] = EAGLE-1/2. Several = a fusion trained for the first
    draft step only (later steps would read the drafter's own output, which training never shows it): evaluation
    takes such drafters at eval.tree_depth 1 only; method eagle3 trains fused layers over several steps."""
    num_layers: int = 1
    """Llama decoder layers in the drafter (layer 0 has no input_layernorm, as in EAGLE-1/2)."""
    fc_norm: bool = True
    """EAGLE-3.1 FC-Norm: RMSNorm on each target feature before it enters fc."""
    post_norm: bool = True
    """EAGLE-3.1 post-norm: an output RMSNorm gives f̂ (loss, logits, next draft step); False = plain EAGLE-2."""
    input_noise: float = 0.0
    """Training-only noise U(-a, a) added to the target features, `a` in absolute units (not scaled by length)."""
    w_feat: float = 1.0
    """Weight of SmoothL1(f̂_{t+1}, f_{t+1})."""
    w_ce: float = 0.1
    """Weight of the soft cross-entropy against the target's next-token distribution."""
    fc_bias: bool = True
    topk_metric: int = 5
    """k of the `acc@k` metric."""

    def validate(self, err) -> None:
        if not self.feature_layers:
            err("drafter.feature_layers", "must list at least one hidden-state index")
        if len(set(self.feature_layers)) != len(self.feature_layers):
            err("drafter.feature_layers", f"has duplicates: {self.feature_layers}")
        if self.num_layers < 1:
            err("drafter.num_layers", f"must be >= 1, got {self.num_layers}")
        if self.input_noise < 0:
            err("drafter.input_noise", f"must be >= 0, got {self.input_noise}")
        if self.w_feat < 0 or self.w_ce < 0 or self.w_feat + self.w_ce == 0:
            err("drafter.w_feat", f"w_feat and w_ce must be >= 0 and not both 0, got {self.w_feat}, {self.w_ce}")
        if self.topk_metric < 1:
            err("drafter.topk_metric", f"must be >= 1, got {self.topk_metric}")
        at_most(err, "drafter.num_layers", self.num_layers, MAX_LAYERS)
        at_most(err, "drafter.topk_metric", self.topk_metric, MAX_VOCAB)

    @property
    def borrows_lm_head(self) -> bool:
        """It drafts through the target's frozen lm_head (borrowed: not one of its parameters)."""
        return True

    def target_sized(self) -> dict[str, int]:
        """Its fields a size of the target bounds (`check_target_sizes`)."""
        return {"num_layers": self.num_layers, "topk_metric": self.topk_metric}

    def without_inputs(self) -> EagleConfig:
        """No input files of its own: itself."""
        return self

    def check_inputs(self, err) -> None:
        """No input files of its own."""

    def check_recipe(self, recipe, err) -> None:
        check_target_sizes(self.target_sized(), recipe, err)
        if -1 not in recipe.data.layers:
            err("data.layers", f"EAGLE regresses the last hidden state: -1 must be stored, got {recipe.data.layers}")


class FusedOwnVocab:
    """What the EAGLE-3 and P-EAGLE configs share: the target's fused low / mid / high features and the drafter's own
    head over a draft vocabulary (fields `method`, `feature_layers`, `draft_vocab`, `step_decay`, `input_noise`,
    `topk_metric`, `loss`, `loss_topk`, `loss_topk_weight`, `loss_eta`: each config declares them)."""

    def validate_fused(self, err) -> None:
        if len(set(self.feature_layers)) != len(self.feature_layers):
            err("drafter.feature_layers", f"has duplicates: {self.feature_layers}")
        if self.draft_vocab < 1:
            err("drafter.draft_vocab", f"must be >= 1, got {self.draft_vocab}")
        if not 0.0 < self.step_decay <= 1.0:
            err("drafter.step_decay", f"must be in (0, 1], got {self.step_decay}")
        if self.input_noise < 0:
            err("drafter.input_noise", f"must be >= 0, got {self.input_noise}")
        if self.topk_metric < 1:
            err("drafter.topk_metric", f"must be >= 1, got {self.topk_metric}")
        if self.loss_topk < 1:
            err("drafter.loss_topk", f"must be >= 1, got {self.loss_topk}")
        if not (self.loss_topk_weight >= 0 and math.isfinite(self.loss_topk_weight)):
            err("drafter.loss_topk_weight", f"must be a finite number >= 0, got {self.loss_topk_weight}")
        if not (self.loss_eta >= 0 and math.isfinite(self.loss_eta)):
            err("drafter.loss_eta", f"must be a finite number >= 0, got {self.loss_eta}")
        at_most(err, "drafter.draft_vocab", self.draft_vocab, MAX_VOCAB)
        at_most(err, "drafter.topk_metric", self.topk_metric, MAX_VOCAB)

    def resolved_layers(self, num_layers: int) -> list[int]:
        """`feature_layers`, or low / mid / high of a `num_layers`-layer target; ValueError when there is none."""
        if self.feature_layers:
            return list(self.feature_layers)
        low_mid_high = [2, num_layers // 2, num_layers - 3]
        if len(set(low_mid_high)) < 3 or num_layers < 8:
            raise ValueError(
                f"drafter.feature_layers: a {num_layers}-layer target has no distinct low/mid/high layers "
                f"{low_mid_high}; list the hidden-state indices to fuse"
            )
        return low_mid_high

    @property
    def borrows_lm_head(self) -> bool:
        """It drafts through its own head over the draft vocabulary, not the target's lm_head."""
        return False

    def target_sized(self) -> dict[str, int]:
        """Its fields a size of the target bounds (`check_target_sizes`)."""
        return {"draft_vocab": self.draft_vocab, "topk_metric": self.topk_metric}

    def without_inputs(self):
        """No input files of its own: itself."""
        return self

    def check_inputs(self, err) -> None:
        """No input files of its own."""

    def check_recipe(self, recipe, err) -> None:
        check_target_sizes(self.target_sized(), recipe, err)
        if -1 not in recipe.data.layers:
            err(
                "data.layers",
                f"{self.method} learns the last hidden state's distribution: -1 must be stored, got "
                f"{recipe.data.layers}",
            )
        if recipe.eval.draft_vocab > self.draft_vocab:  # a smaller draft vocabulary keeps rows of its own head
            err(
                "eval.draft_vocab",
                f"{recipe.eval.draft_vocab} is more than the drafter's own draft vocabulary (drafter.draft_vocab: "
                f"{self.draft_vocab})",
            )
        if recipe.train.loss_vocab:
            err(
                "train.loss_vocab",
                f"{self.method} learns over its own draft vocabulary (drafter.draft_vocab); set it to 0",
            )
        n_layers = recipe.target.num_layers
        if n_layers is None:
            return
        try:
            layers = self.resolved_layers(n_layers)
        except ValueError as exc:
            err("drafter.feature_layers", str(exc).split(": ", 1)[1])
            return
        missing = [layer for layer in [*layers, -1] if layer not in recipe.data.layers]
        if missing:
            err("data.layers", f"must store the drafter's layers {layers} and -1; missing {missing}")


@dataclass
class Eagle3Config(FusedOwnVocab):
    """EAGLE-3 / EAGLE-3.1 drafter (recipe section `drafter`, `method: eagle3`)."""

    method: Literal["eagle3"] = "eagle3"
    feature_layers: list[int] = field(default_factory=list)
    """Target hidden-state indices fused by `fc` (HF `output_hidden_states` indexing: i = the input of decoder layer
    i). Empty = low / mid / high, `[2, L // 2, L - 3]` for an L-layer target (needs L >= 8). `data.layers` must
    store them and -1 (the last hidden state, whose distribution the drafter learns)."""
    draft_vocab: int = 32000
    """K: the drafter's own LM head covers the K most frequent loss tokens of the training data (`d2t` / `t2d`)."""
    ttt_steps: int = 7
    """Training-time test: the drafter is unrolled this many steps, each fed its own output of the step before."""
    step_decay: float = 0.8
    """Weight of unrolled step j (0-based) in the loss: step_decay ** j."""
    fc_norm: bool = False
    """EAGLE-3.1 FC-Norm: an RMSNorm on each target feature before `fc`."""
    norm_output: bool = False
    """EAGLE-3.1 post-norm: the next draft step reads the output after the final norm (EAGLE-3: before it)."""
    norm_before_residual: bool = False
    """The decoder layer's residual is the normed input feature (`hidden_norm(g)`) instead of g itself."""
    input_noise: float = 0.0
    """Training-only noise U(-a, a) added to the target features."""
    topk_metric: int = 5
    """k of the `acc@k` metric."""
    loss: DraftLoss = "kl"
    """What each unrolled step learns at a position (models/losses.py): `kl` (EAGLE-3's soft cross-entropy against the
    target's distribution), `hass` (plus HASS's top-K distillation), `tv`, `nla` or `lk_hybrid` (LK losses: the
    acceptance rate itself)."""
    loss_topk: int = 10
    """hass: the target's K most likely tokens whose log-probabilities the extra term weighs."""
    loss_topk_weight: float = 1.0
    """hass: weight of the top-K term beside the soft cross-entropy."""
    loss_eta: float = 3.0
    """lk_hybrid: λ = exp(-loss_eta · α), the share of KL beside total variation at a position."""

    def validate(self, err) -> None:
        self.validate_fused(err)
        if self.ttt_steps < 1:
            err("drafter.ttt_steps", f"must be >= 1, got {self.ttt_steps}")
        at_most(err, "drafter.ttt_steps", self.ttt_steps, MAX_TTT_STEPS)


@dataclass
class PeagleConfig(FusedOwnVocab):
    """P-EAGLE drafter (recipe section `drafter`, `method: peagle`): EAGLE-3's drafter that drafts
    `parallel_tokens` tokens in one forward, through mask slots appended after the real positions."""

    method: Literal["peagle"] = "peagle"
    feature_layers: list[int] = field(default_factory=list)
    """As EAGLE-3's: the fused hidden-state indices (empty = low / mid / high)."""
    draft_vocab: int = 32000
    """K: its own LM head covers the K most frequent loss tokens of the training data (`d2t` / `t2d`)."""
    parallel_tokens: int = 4
    """Tokens drafted per forward: the real last position drafts the first, `parallel_tokens - 1` mask slots the
    others. Training unrolls as many steps (step j >= 1 reads the mask slot's inputs, not its own outputs)."""
    mask_token_id: int = 0
    """A token of the target's vocabulary whose (frozen) embedding every mask slot reads, beside the learned
    `mask_hidden` features; any token will do, the learned features carry the slot."""
    step_decay: float = 0.8
    """Weight of unrolled step j (0-based, = mask slot j) in the loss: step_decay ** j."""
    fc_norm: bool = False
    """EAGLE-3.1 FC-Norm: an RMSNorm on each target feature (and on each chunk of `mask_hidden`) before `fc`."""
    norm_before_residual: bool = False
    """The decoder layer's residual is the normed input feature (`hidden_norm(g)`) instead of g itself."""
    input_noise: float = 0.0
    """Training-only noise U(-a, a) added to the target features."""
    topk_metric: int = 5
    """k of the `acc@k` metric."""
    loss: DraftLoss = "kl"
    """As EAGLE-3's: `kl`, `hass`, `tv`, `nla` or `lk_hybrid` (models/losses.py)."""
    loss_topk: int = 10
    """hass: the target's K most likely tokens whose log-probabilities the extra term weighs."""
    loss_topk_weight: float = 1.0
    """hass: weight of the top-K term beside the soft cross-entropy."""
    loss_eta: float = 3.0
    """lk_hybrid: λ = exp(-loss_eta · α)."""

    @property
    def ttt_steps(self) -> int:
        """Unrolled training steps: one per drafted token."""
        return self.parallel_tokens

    @property
    def norm_output(self) -> bool:
        """No draft step reads another's output (mask slots read `mask_hidden`): no post-norm switch."""
        return False

    def validate(self, err) -> None:
        self.validate_fused(err)
        if self.parallel_tokens < 1:
            err("drafter.parallel_tokens", f"must be >= 1, got {self.parallel_tokens}")
        if self.mask_token_id < 0:
            err("drafter.mask_token_id", f"must be >= 0, got {self.mask_token_id}")
        at_most(err, "drafter.parallel_tokens", self.parallel_tokens, MAX_TTT_STEPS)

    def check_recipe(self, recipe, err) -> None:
        super().check_recipe(recipe, err)
        vocab = recipe.target.size("vocab_size")
        if vocab is not None and self.mask_token_id >= vocab:
            err("drafter.mask_token_id", f"{self.mask_token_id} is not below the target's vocab_size ({vocab})")
        tree, K = recipe.eval.tree, self.parallel_tokens
        if tree in ("chain", "calibrated") and recipe.eval.tree_depth > K:
            err("eval.tree_depth", f"{recipe.eval.tree_depth} exceeds the tokens one forward drafts ({K})")
        if tree in named_trees.NAMED_TREES:
            depth, top_k = named_trees.depth(tree), named_trees.top_k(tree)
            if K < depth:
                err("eval.tree", f"{tree} is {depth} deep and needs drafter.parallel_tokens >= {depth}, got {K}")
            if min(self.draft_vocab, recipe.eval.draft_vocab or self.draft_vocab) < top_k:
                err("eval.tree", f"{tree} drafts each depth's top {top_k} tokens, more than the draft vocabulary")


@dataclass
class MedusaConfig:
    """Medusa-1 heads (recipe section `drafter`, `method: medusa1`)."""

    method: Literal["medusa1"] = "medusa1"
    num_heads: int = 5
    """K: head k (1-based) predicts token t+k+1 from the hidden state at t."""
    num_layers: int = 1
    """L: residual blocks `h + SiLU(W1 h + b1)` per head, each with its own parameters."""
    decay: float = 0.8
    """λ_k = decay**k for head k = 1..K (head 1 weighs 0.8, head 2 0.64, ...)."""
    share_lm_head: bool = False
    """True: all heads project with the frozen target lm_head; False: each head trains its own copy."""

    @property
    def feature_layers(self) -> list[int]:
        """Hidden-state indices the heads read: the target's last hidden state (after the final norm)."""
        return [-1]

    def validate(self, err) -> None:
        if self.num_heads < 1:
            err("drafter.num_heads", f"must be >= 1, got {self.num_heads}")
        if self.num_layers < 1:
            err("drafter.num_layers", f"must be >= 1, got {self.num_layers}")
        if not 0.0 < self.decay <= 1.0:
            err("drafter.decay", f"must be in (0, 1], got {self.decay}")
        at_most(err, "drafter.num_heads", self.num_heads, MAX_HEADS)
        at_most(err, "drafter.num_layers", self.num_layers, MAX_LAYERS)

    @property
    def borrows_lm_head(self) -> bool:
        """Its heads project through the target's frozen lm_head (`share_lm_head`), not copies of their own."""
        return self.share_lm_head

    def target_sized(self) -> dict[str, int]:
        """Its fields a size of the target bounds (`check_target_sizes`)."""
        return {"num_layers": self.num_layers}

    def without_inputs(self) -> MedusaConfig:
        """No input files of its own: itself."""
        return self

    def check_inputs(self, err) -> None:
        """No input files of its own."""

    def check_recipe(self, recipe, err) -> None:
        check_target_sizes(self.target_sized(), recipe, err)
        tree = recipe.eval.tree
        if tree in ("chain", "calibrated") and recipe.eval.tree_depth > self.num_heads:
            err("eval.tree_depth", f"{recipe.eval.tree_depth} exceeds the number of Medusa heads ({self.num_heads})")
        if tree in named_trees.NAMED_TREES:
            depth, top_k = named_trees.depth(tree), named_trees.top_k(tree)
            if self.num_heads < depth:
                err(
                    "eval.tree",
                    f"{tree} is {depth} deep and needs >= {depth} heads, drafter.num_heads is {self.num_heads}",
                )
            if 0 < recipe.eval.draft_vocab < top_k:
                err("eval.draft_vocab", f"{tree} drafts each head's top {top_k} tokens, got {recipe.eval.draft_vocab}")
        if recipe.train.loss_vocab and not self.share_lm_head:
            err("train.loss_vocab", "needs drafter.share_lm_head: heads with their own lm_head train every row of it")


@dataclass
class Medusa2Config(MedusaConfig):
    """Medusa-2 (recipe section `drafter`, `method: medusa2`): Medusa-1's head fields (with `share_lm_head` matching
    the stage-1 heads) plus the LoRA backbone's; runs online only."""

    method: Literal["medusa2"] = "medusa2"
    lora_r: int = 32
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: list(LLAMA_LINEAR_LAYERS))
    """Module names that get LoRA adapters (defaults: every linear layer of a Llama-style decoder)."""
    self_distill: bool = False
    """L_base = KL(p_target ‖ p_adapted) (teacher = the same weights with adapters off) instead of next-token CE:
    for self-distilled data, where the paper finds hard-label CE degrades the model; the KL keeps its distribution."""
    head_loss_coef: float = 0.2
    """Weight of the head losses against L_base. The Medusa paper uses 0.2, and 0.01 under self-distillation
    (the KL term is much smaller than a CE, so the heads would otherwise dominate the backbone's updates)."""
    alpha_schedule: Literal["constant", "linear", "sine"] = "constant"
    """Warm-up of the head-loss weight α(step) from 0 to 1 over alpha_warmup_steps (constant: always 1)."""
    alpha_warmup_steps: int = 0
    stage1_heads: str | None = None
    """Stage 2 starts from these Medusa-1 heads: a native export directory (config.json + model.safetensors),
    a checkpoint directory (drafter.safetensors) or a .safetensors file; null = fresh heads."""
    gradient_checkpointing: bool = False
    """Recompute decoder activations in backward (large targets, long sequences)."""

    def heads_config(self) -> MedusaConfig:
        return MedusaConfig(
            num_heads=self.num_heads, num_layers=self.num_layers, decay=self.decay, share_lm_head=self.share_lm_head
        )

    def alpha(self, step: int) -> float:
        """α(step) ∈ [0, 1] after `step` optimizer steps (the head-loss warm-up of the Medusa-2 trainer)."""
        if self.alpha_schedule == "constant" or self.alpha_warmup_steps == 0:
            return 1.0
        x = min(1.0, step / self.alpha_warmup_steps)
        return x if self.alpha_schedule == "linear" else math.sin(0.5 * math.pi * x)

    def validate(self, err) -> None:
        super().validate(err)
        if self.lora_r < 1:
            err("drafter.lora_r", f"must be >= 1, got {self.lora_r}")
        if self.lora_alpha < 1:
            err("drafter.lora_alpha", f"must be >= 1, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            err("drafter.lora_dropout", f"must be in [0, 1), got {self.lora_dropout}")
        if not self.lora_target_modules:
            err("drafter.lora_target_modules", "must name at least one module (e.g. q_proj)")
        if self.head_loss_coef < 0:
            err("drafter.head_loss_coef", f"must be >= 0, got {self.head_loss_coef}")
        if self.alpha_warmup_steps < 0:
            err("drafter.alpha_warmup_steps", f"must be >= 0, got {self.alpha_warmup_steps}")
        at_most(err, "drafter.lora_r", self.lora_r, MAX_RANK)

    def target_sized(self) -> dict[str, int]:
        """Its fields a size of the target bounds (`check_target_sizes`): Medusa-1's and the LoRA rank."""
        return {**super().target_sized(), "lora_r": self.lora_r}

    def without_inputs(self) -> Medusa2Config:
        """Without its stage-1 heads: what rebuilds a drafter whose trained tensors come from elsewhere (a checkpoint,
        an export), which hold the heads trained on from them."""
        return dataclasses.replace(self, stage1_heads=None)

    def check_inputs(self, err) -> None:
        """Before training: the stage-1 heads exist in one of the forms `load_stage1_heads` reads."""
        if self.stage1_heads is not None:
            stage1_form(Path(self.stage1_heads), lambda msg: err("drafter.stage1_heads", msg))

    # check_recipe: Medusa-1's (the heads draft the same trees)


def stage1_form(path: Path, fail) -> Path:
    """The safetensors file of stage-1 heads at `path` (export, checkpoint or file); else `fail(message)`."""
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            fail(f"{path / 'config.json'}: not valid JSON ({exc})")
        if not isinstance(config, dict) or config.get("method") != "medusa1":
            method = config.get("method") if isinstance(config, dict) else None
            fail(f"{path}: an export of method {method!r}, expected medusa1 heads")
        return path / "model.safetensors"
    if (path / "drafter.safetensors").is_file():
        return path / "drafter.safetensors"
    if path.is_file() and path.suffix == ".safetensors":
        return path
    if not path.exists():
        fail(f"{path}: not a Medusa-1 export: no such file or directory (train stage 1 and export it first)")
    fail(
        f"{path}: not a Medusa-1 export (config.json + model.safetensors), checkpoint (drafter.safetensors) "
        "or .safetensors file"
    )
