"""The training loop: one for every drafter method.

    accelerate launch [--config_file recipes/accelerate/X.yaml] -m train RECIPE [key=value ...]

target -> TargetParts -> drafter (`METHODS[method].module()`) -> AdamW groups + warm-up/cosine ->
`accelerator.prepare` (DDP, DeepSpeed ZeRO-2/3 or FSDP, as the accelerate config says).

One optimizer step takes `grad_accum` micro-batches per process. Their loss tokens are counted and
summed over processes (N) before any backward, and micro-batch i backpropagates
`loss_i · n_i / N · world · grad_accum`: accelerate divides by grad_accum and DDP averages over
processes, so the gradient is exactly Σ(per-token losses) / N however the step is split (4×1 = 1×4).
Offline runs read feature shards; online runs (`train.online`) compute the hidden states with the
target inside the step, unless the method's training inputs are tokens (`Method.inputs`).
Every step is appended to `<output_dir>/metrics.jsonl`; checkpoints allow exact resumption (`train.resume`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from tqdm import tqdm
from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

from data import target_stats
from data.extract import feature_identity
from data.heldout import write_heldout
from data.loader import BatchLoader
from data.prepare import prepare_dataset
from data.shards import FeatureDataset, FeatureMismatchError, split_by_id
from data.vocab_counts import frequent_loss_tokens
from methods import METHODS
from models.common import DraftBatch, packed_additive_mask
from models.host import keep_freed_memory
from models.io import DRAFT_VOCAB_FILE, ExportError, draft_vocab_sha256, load_draft_vocab, save_draft_vocab
from models.target import Target, load_placed_target
from rundir.checkpoints import read_state
from rundir.lock import DirectoryLocked, NotADirectory, acquire_for_all, release
from schema.recipe import Recipe
from train import TrainingError
from train.checkpoint import METRICS_FILE, RECIPE_FILE
from train.curves import plot_curves
from train.launch import make_accelerator, tracker_config, tracker_kwargs
from train.optim import build_optimizer, build_scheduler, reschedule
from train.resume import checkpoint_to_resume, restore_run, save_run, truncate_metrics


def build_target(recipe: Recipe, accelerator: Accelerator) -> Target:
    """The frozen target, whole on every process's device, or spread as `target.device_map` says
    (`models.target.load_placed_target`).

    Under ZeRO-3, transformers would partition any model built while accelerate's DeepSpeed config
    is registered (`zero.Init`), so the target is loaded with it unregistered.
    """
    placed = recipe.target.device_map is not None
    if placed and METHODS[recipe.drafter.method].adapts_target:
        raise TrainingError(
            f"{recipe.source}: target.device_map: {recipe.drafter.method} trains the target's own layers (LoRA), which "
            "a device map leaves to accelerate's hooks; train it with the target whole on each device (DeepSpeed/FSDP "
            "shard it)"
        )
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        unset_hf_deepspeed_config()
    try:
        target = load_placed_target(dataclasses.asdict(recipe.target), accelerator)
    finally:
        if plugin is not None and plugin.dschf is not None:
            set_hf_deepspeed_config(plugin.dschf)
    if placed:  # the drafter borrows the embedding and the head: they must be where it trains
        away = [f"{name} ({module.weight.device})" for name, module in
                (("model.embed_tokens", target.embed_tokens), ("lm_head", target.lm_head))
                if module.weight.device != accelerator.device]  # fmt: skip
        if away:
            raise TrainingError(
                f"{recipe.source}: target.device_map: the drafter borrows the target's {' and '.join(away)}, which "
                f"must be on this process's device {accelerator.device}; place them there in an explicit map"
            )
    return target


def _check_zero3_sharing(accelerator: Accelerator, recipe: Recipe, target: Target, drafter: torch.nn.Module) -> None:
    """ZeRO-3 partitions every drafter tensor, including any it shares with the target: fine offline, where
    the target does not run, but not online. EAGLE and Medusa-1 borrow the target's embedding / lm_head
    unregistered (`models.common.FrozenRef`), so they share none and run online under ZeRO-3; Medusa-2's
    LoRA backbone is the target's own tensors, registered because it trains, and is refused here."""
    plugin = accelerator.state.deepspeed_plugin
    if not recipe.train.online or plugin is None or plugin.zero_stage != 3:
        return
    shared = {p.data_ptr() for p in target.model.parameters()} & {p.data_ptr() for p in drafter.parameters()}
    if shared:
        raise TrainingError(
            f"{recipe.source}: train.online: the drafter shares {len(shared)} tensors with the target, which ZeRO-3 "
            "would partition under the running target; use ZeRO-2 or DDP online, or train offline from features"
        )


def _features_problem(message: str, extract: str) -> str:
    """A feature error's message saying once how to fix it, with `extract` (the extraction command of the recipe as
    loaded, overrides included): shard errors already say to re-run `python -m data.extract RECIPE` (which
    re-extracts exactly the bad shards) or to extract again, settings mismatches say neither."""
    generic = "python -m data.extract RECIPE"
    if "built with dtype=" in message:
        return f"{message}: data.storage_dtype must say how they are stored (or re-extract with `{extract}`)"
    if generic in message:
        return message.replace(generic, extract)
    if "extract again" in message:
        return message.replace("extract again", f"extract again with `{extract}`")
    return f"{message} (re-extract with `{extract}`)"


def sample_ids(samples, positions) -> list[int | str]:
    """The data ids of these positions of feature shards or token samples."""
    if isinstance(samples, FeatureDataset):
        return [samples.sample_ids[i] for i in positions]
    return [samples[i]["id"] for i in positions]


def build_loaders(
    recipe: Recipe, target: Target, accelerator: Accelerator
) -> tuple[BatchLoader, BatchLoader | None, list[int]]:
    """(training batches, the evaluated held-out batches or None, every held-out position): feature shards checked
    against the target, or token data (online)."""
    data, cfg = recipe.data, recipe.train
    if cfg.online:
        samples = prepare_dataset(data, target.tokenizer).samples
        train_idx, heldout_idx = split_by_id([s["id"] for s in samples], data.heldout_fraction, cfg.seed)
    else:
        if data.features_dir is None:
            raise TrainingError(
                f"{recipe.source}: data.features_dir is not set: offline training reads feature shards "
                f"(run `{recipe.command('data.extract')}`) or set train.online=true"
            )
        # Each process hashes every N-th shard (1/N of the hashing each) and all of them share the verdicts: the
        # first problem found on any process stops every process with the same message, before any of them
        # reaches a collective that the others would never join.
        problem: str | None = None
        try:
            samples = FeatureDataset(
                data.features_dir,
                verify_checksums=data.verify_checksums,
                # the recipe says how its features are stored; a set stored otherwise is not what it describes
                expect=feature_identity(target, data) | {"dtype": data.storage_dtype},
                verify_shards=(accelerator.process_index, accelerator.num_processes),
            )
        except (FeatureMismatchError, FileNotFoundError) as exc:
            problem = _features_problem(str(exc), recipe.command("data.extract"))
        problems = [p for p in gather_object([problem]) if p is not None]
        if problems:
            raise TrainingError(f"{recipe.source}: data.features_dir: {problems[0]}")
        train_idx, heldout_idx = samples.split(data.heldout_fraction, cfg.seed)
        if METHODS[recipe.drafter.method].target_statistics and not cfg.loss_vocab:
            line = target_stats.attach(samples, target.lm_head)
            if accelerator.is_main_process:
                print(line)
    if cfg.first_records is not None:  # sample ids are record numbers over the data, in order
        train_idx = [i for i, sid in zip(train_idx, sample_ids(samples, train_idx)) if int(sid) < cfg.first_records]
        if not train_idx:
            raise TrainingError(
                f"{recipe.source}: train.first_records: no training sample among the first {cfg.first_records} records"
            )
    if accelerator.is_main_process:  # evaluation calibrates on these samples, never on training ones
        write_heldout(cfg.output_dir, sample_ids(samples, heldout_idx))
    common = dict(
        batch_size=cfg.batch_size,
        accum=cfg.grad_accum,
        packing=cfg.packing,
        max_len=data.max_len,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        seed=cfg.seed,
        device=accelerator.device,  # encoded features are decoded there, a batch at a time
    )
    train_loader = BatchLoader(samples, train_idx, shuffle=True, **common)
    # every evaluated held-out sample counts once, whatever the accumulation and the number of processes
    held = dict(common, accum=1)
    evaluated = evaluated_heldout(heldout_idx, cfg.eval_batches * cfg.batch_size, cfg.seed)
    heldout_loader = BatchLoader(samples, evaluated, shuffle=False, score_fill=False, **held) if evaluated else None
    return train_loader, heldout_loader, heldout_idx


def seed_process_streams(accelerator: Accelerator, seed: int) -> None:
    """After the drafter is built alike on every process (one seed, identical initial weights, as FSDP needs): give
    each process its own random streams, so that input noise and dropout differ between the processes' batches
    instead of repeating one pattern (a resume on another number of processes reseeds the same way)."""
    if accelerator.num_processes > 1:
        set_seed(seed + accelerator.process_index)


def evaluated_heldout(heldout_idx: list[int], cap: int, seed: int) -> list[int]:
    """The held-out samples each evaluation scores: all of them, or `cap` (eval_batches x batch_size) drawn at random
    with `seed`: the same ones whatever the number of processes, and not the shortest (feature shards are stored
    by length, so the split's first batches would be an easier subset)."""
    if len(heldout_idx) <= cap:
        return list(heldout_idx)
    return sorted(random.Random(seed).sample(list(heldout_idx), cap))


# --------------------------------------------------------------------------------------------
# One step


def _to_device(batch: dict, device: torch.device) -> DraftBatch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}


def target_hidden(target: Target, batch: DraftBatch, layers: list[int]) -> torch.Tensor:
    """(B, T, n, d) target hidden states of a (packed, padded) token batch, as extraction stores them.

    A 4D additive mask keeps packed samples apart (a 2D mask would let them attend to each other).
    """
    mask = packed_additive_mask(batch, target.dtype)  # (B, 1, T, T)
    with torch.no_grad():
        hidden = target.hidden_states(batch["input_ids"], mask, batch["position_ids"], layers=layers)  # (B, T, n, d)
    return hidden.to(batch["input_ids"].device)  # a device_map target ends on its last device


class Stepper:
    """Runs forward/backward over the micro-batches of one optimizer step and evaluation batches."""

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, target: Target, recipe: Recipe):
        self.accelerator, self.model, self.target = accelerator, model, target
        self.layers = list(recipe.data.layers)
        self.needs_hidden = recipe.train.online and METHODS[recipe.drafter.method].inputs == "features"

    def prepare(self, batch: dict) -> DraftBatch:
        batch = _to_device(batch, self.accelerator.device)
        if self.needs_hidden:
            batch["hidden"] = target_hidden(self.target, batch, self.layers)
        return batch

    def _reduce(self, sums: dict[str, torch.Tensor], n_total: torch.Tensor) -> dict[str, float]:
        """Token-weighted means over every micro-batch of every process (one collective, one sync)."""
        keys = sorted(sums)
        total = self.accelerator.reduce(torch.stack([sums[k] for k in keys]), reduction="sum")
        return dict(zip(keys, (total / n_total).tolist()))

    def train_step(self, micro_batches: list[dict]) -> tuple[dict[str, float], float]:
        """Forward/backward of one step (no optimizer step); returns (token-weighted metrics, global tokens).

        Loss tokens are counted on the host batches first; each micro-batch then goes to the device
        (and through the target, online) only when its turn comes.
        """
        acc = self.accelerator
        n_local = [b["loss_mask"].sum().float() for b in micro_batches]
        tokens_local = sum(b["attention_mask"].sum().float() for b in micro_batches)
        counts = acc.reduce(torch.stack([sum(n_local), tokens_local]).to(acc.device), reduction="sum")
        n_total = counts[0].clamp_min(1.0)
        scale = acc.num_processes * acc.gradient_accumulation_steps / n_total
        sums: dict[str, torch.Tensor] = {}
        for raw, n in zip(micro_batches, n_local):
            batch = self.prepare(raw)
            with acc.accumulate(self.model):
                out = self.model(batch)
                acc.backward(out["loss"] * n.to(acc.device) * scale)
            for key, value in out.items():
                sums[key] = sums.get(key, 0.0) + value.detach().float() * n.to(acc.device)
        return self._reduce(sums, n_total), counts[1].item()

    @torch.no_grad()
    def evaluate(self, loader: BatchLoader) -> dict[str, float]:
        """Loss-token-weighted metrics over every batch of `loader` (the evaluated held-out samples)."""
        self.model.eval()
        sums: dict[str, torch.Tensor] = {}
        n_total = torch.zeros((), device=self.accelerator.device)
        for raw in loader.epoch(0):
            batch = self.prepare(raw)
            n = batch["loss_mask"].sum().float()
            for key, value in self.model(batch).items():
                sums[key] = sums.get(key, 0.0) + value.float() * n
            n_total += n
        self.model.train()
        n_total = self.accelerator.reduce(n_total, reduction="sum").clamp_min(1.0)
        return self._reduce(sums, n_total)


# --------------------------------------------------------------------------------------------
# The loop


def set_draft_vocab(
    recipe: Recipe, drafter: torch.nn.Module, samples, skip_ids, accelerator: Accelerator, checkpoint: Path | None
) -> None:
    """A drafter with its own vocabulary drafts the `drafter.draft_vocab` most frequent loss tokens of the training
    split (the held-out samples, `skip_ids`, left out: the held-out metrics then measure tokens chosen without them;
    the same on every process: all of them count the whole split); the run directory keeps them
    (`draft_vocab.safetensors`) for exports and for evaluation of its checkpoints. A resumed run keeps the
    vocabulary it recorded, whatever the data or the counting says now, and refuses one that is not what
    `checkpoint` (the one it resumes from) was trained with."""
    size = recipe.drafter.draft_vocab
    path = Path(recipe.train.output_dir) / DRAFT_VOCAB_FILE
    try:
        recorded = load_draft_vocab(recipe.train.output_dir) if checkpoint is not None else None
    except ExportError as exc:
        raise TrainingError(f"{exc}; restart the run without train.resume") from None
    if recorded is not None:
        kept = read_state(checkpoint).get("draft_vocab_sha256") if checkpoint is not None else None
        if kept is not None and kept != draft_vocab_sha256(recorded):
            raise TrainingError(
                f"{path}: not the draft vocabulary {checkpoint} was trained with (its head rows belong to other "
                "tokens): restore that file, or start a new run"
            )
        if len(recorded) != size:
            raise TrainingError(
                f"{path}: {len(recorded)} draft tokens, but drafter.draft_vocab is {size}: the run was started with "
                "another draft vocabulary; resume with that setting or start a new run"
            )
        drafter.set_draft_vocab(recorded.to(accelerator.device), init_head=False)  # the checkpoint holds the head
        return
    vocab = frequent_loss_tokens(samples, size, skip_ids)
    if len(vocab) < size:
        raise TrainingError(
            f"{recipe.source}: drafter.draft_vocab: {size} asked, the training split has {len(vocab)} distinct loss "
            f"tokens (lower drafter.draft_vocab to at most {len(vocab)})"
        )
    drafter.set_draft_vocab(vocab.to(accelerator.device), init_head=True)  # a resume then loads the trained head
    if accelerator.is_main_process:
        Path(recipe.train.output_dir).mkdir(parents=True, exist_ok=True)
        save_draft_vocab(recipe.train.output_dir, vocab)


MIN_IN_VOCAB = 0.9


def draft_vocab_warning(in_vocab: float, recipe: Recipe) -> str | None:
    """A drafter with its own vocabulary learns only where the target's top-1 token is inside it; a warning when the
    held-out split shows that too few loss positions are (the rest give no loss), None otherwise."""
    if in_vocab >= MIN_IN_VOCAB:
        return None
    return (
        f"warning: {recipe.source}: only {in_vocab:.0%} of held-out loss positions have the target's top-1 token "
        f"inside the draft vocabulary (drafter.draft_vocab={recipe.drafter.draft_vocab}); the others give no loss. "
        "Raise drafter.draft_vocab, or train on the target's own answers (python -m data.selfdistill)"
    )


def lock_run_dir(recipe: Recipe, accelerator: Accelerator) -> int | None:
    """Take the run directory's lock (`rundir.lock`) on the main process, before anything reads or writes the run:
    a second training into the same `train.output_dir` stops on every one of its processes with the same line,
    naming the directory (the other processes of one launch share the main process's lock). Returns the lock to
    release (main process), else None."""
    key = f"{recipe.source}: train.output_dir"
    try:
        return acquire_for_all(recipe.train.output_dir, "training", key, accelerator.is_main_process, gather_object)
    except (DirectoryLocked, NotADirectory) as exc:
        raise TrainingError(str(exc)) from None


def train(recipe: Recipe, stop_after: int | None = None) -> Path:
    """Train `recipe`'s drafter; return the newest checkpoint. `stop_after`: checkpoint after that step and return.
    The run directory is locked meanwhile: another training into it is refused."""
    accelerator = make_accelerator(recipe)
    keep_freed_memory(accelerator.device)  # on a CPU: no page faults for every large temporary of a step
    lock = lock_run_dir(recipe, accelerator)
    try:
        return _train(recipe, accelerator, stop_after)
    finally:
        if lock is not None:
            release(lock)


def _train(recipe: Recipe, accelerator: Accelerator, stop_after: int | None) -> Path:
    cfg = recipe.train
    out_dir = Path(cfg.output_dir)
    resume = checkpoint_to_resume(recipe, accelerator)
    set_seed(cfg.seed)
    target = build_target(recipe, accelerator)
    train_loader, heldout_loader, heldout_idx = build_loaders(recipe, target, accelerator)
    trained_on = set(train_loader.indices)  # the training split (less what train.first_records leaves out)
    skip = sample_ids(train_loader.samples, [i for i in range(len(train_loader.samples)) if i not in trained_on])
    parts = target.parts(recipe.data.layers)
    if cfg.loss_vocab:  # offline only (checked at load): the loader's samples are the feature shards
        vocab = frequent_loss_tokens(train_loader.samples, cfg.loss_vocab, skip)
        parts = parts.restricted(vocab.to(accelerator.device))
    method = METHODS[recipe.drafter.method]
    drafter = method.module()(recipe.drafter, parts)
    if method.own_vocab:
        set_draft_vocab(recipe, drafter, train_loader.samples, skip, accelerator, checkpoint=resume)
    _check_zero3_sharing(accelerator, recipe, target, drafter)
    optimizer = build_optimizer(drafter, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    model, optimizer = accelerator.prepare(drafter, optimizer)
    seed_process_streams(accelerator, cfg.seed)

    step, tokens_seen, warned = 0, 0.0, False
    if resume is not None:
        saved = restore_run(accelerator, model, optimizer, scheduler, train_loader, resume, cfg.seed)
        step, tokens_seen = saved["step"], saved["tokens_seen"]
        if reschedule(scheduler, cfg.warmup_steps, cfg.max_steps) and accelerator.is_main_process:
            print(
                f"{resume}: its learning-rate schedule had other train.warmup_steps / train.max_steps; from step "
                f"{step} it follows the recipe's ({cfg.warmup_steps} warm-up steps, cosine to 0 at {cfg.max_steps})"
            )
    if accelerator.is_main_process:
        n, kind = accelerator.num_processes, accelerator.device.type
        kind = kind if n == 1 else f"{accelerator.distributed_type.value}, {kind}"
        print(  # a launch that came up with fewer processes than meant trains on smaller batches: say it up front
            f"training {recipe.drafter.method} on {n} process{'es' if n > 1 else ''} ({kind}): global batch "
            f"{cfg.batch_size * cfg.grad_accum * n} = train.batch_size {cfg.batch_size} x grad_accum {cfg.grad_accum} "
            f"x {n}, to step {cfg.max_steps} -> {out_dir}"
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        recipe.save(out_dir / RECIPE_FILE)
        truncate_metrics(out_dir / METRICS_FILE, step)
    accelerator.init_trackers(
        recipe.logging.project, config=tracker_config(recipe), init_kwargs=tracker_kwargs(recipe, accelerator)
    )

    stepper = Stepper(accelerator, model, target, recipe)
    batches = train_loader.batches()  # endless, from where the loader state says
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not accelerator.is_main_process, desc="train")
    last_ckpt = resume
    try:
        while step < cfg.max_steps:
            t0 = time.perf_counter()
            lr = cfg.lr * scheduler.lr_lambdas[0](scheduler.last_epoch)  # train.lr as scheduled (heads: x mult)
            if method.step_dependent:  # losses that depend on training progress (Medusa-2's α warm-up)
                drafter.set_step(step)
            metrics, tokens = stepper.train_step([next(batches) for _ in range(cfg.grad_accum)])
            if not math.isfinite(metrics["loss"]):
                raise TrainingError(
                    f"non-finite training loss ({metrics['loss']}) at step {step + 1}; last good checkpoint: "
                    f"{last_ckpt or 'none'} (lower train.lr or check the data, then resume with train.resume=<dir>)"
                )
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm or math.inf)
            # before the optimizer step: clipping an infinite norm turns every gradient into nan, and the weights
            # with it (a loss weight such as drafter.w_ce=1e30 overflows here while the loss is still finite)
            if grad_norm is not None and not math.isfinite(float(grad_norm)):
                raise TrainingError(
                    f"non-finite gradient norm ({float(grad_norm)}) at step {step + 1}; last good checkpoint: "
                    f"{last_ckpt or 'none'} (lower train.lr or the drafter's loss weights, or check the data, then "
                    "resume with train.resume=<dir>)"
                )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens
            elapsed = time.perf_counter() - t0
            log = {f"train/{k}": v for k, v in metrics.items()}
            log.update({"train/lr": lr, "train/tokens_per_s": tokens / elapsed, "train/tokens_seen": tokens_seen})
            if grad_norm is not None:  # DeepSpeed clips inside its step and reports nothing here
                log["train/grad_norm"] = float(grad_norm)
            evaluate = (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps
            if heldout_loader is not None and evaluate:
                held = stepper.evaluate(heldout_loader)
                log.update({f"eval/{k}": v for k, v in held.items()})
                if accelerator.is_main_process:
                    tqdm.write(f"step {step}: held-out " + "  ".join(f"{k} {v:.4f}" for k, v in sorted(held.items())))
                    if not warned and "in_vocab" in held and (warning := draft_vocab_warning(held["in_vocab"], recipe)):
                        tqdm.write(warning)
                        warned = True
            if accelerator.is_main_process:
                with open(out_dir / METRICS_FILE, "a") as f:
                    f.write(json.dumps({"step": step, **log}) + "\n")
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens / elapsed:.0f}")
                bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.max_steps or evaluate:
                accelerator.log(log, step=step)
            stop = stop_after is not None and step >= stop_after
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.max_steps or stop:
                last_ckpt = save_run(accelerator, model, optimizer, scheduler, recipe, step, train_loader, tokens_seen)
                if accelerator.is_main_process:
                    plot_curves(out_dir)  # curves.png beside metrics.jsonl, as far as the run has come
            if stop:
                break
    finally:
        bar.close()
        accelerator.end_training()
    if accelerator.is_main_process:
        print(f"metrics: {out_dir / METRICS_FILE} (curves: {out_dir / 'curves.png'})")
        if step >= cfg.max_steps:
            print(f"export: python -m export {out_dir}")
        print(f"last checkpoint: {last_ckpt}")
    return last_ckpt
