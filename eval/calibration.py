"""What an evaluation builds a drafter's proposer from, besides the drafter: the measured rank accuracies that
calibrate static trees (on the training run's held-out samples), the draft vocabulary an export asks for, the
two-stage head's fitting data, and the attention window. `eval.run` calls them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from data.heldout import HELDOUT_FILE, read_heldout
from data.prepare import prepare_dataset
from data.shards import FeatureDataset, split_by_id
from data.vocab_counts import frequent_loss_tokens, loss_token_counts
from eval import EvalError
from eval.heads import FitData, shard_fit_data
from methods import Method
from models.io import load_draft_vocab, read_config
from models.target import Target
from schema.evaluation import EvalConfig
from schema.recipe import Recipe

CALIBRATION_SAMPLES = 64


@torch.inference_mode()
def medusa_rank_accuracy(
    heads: torch.nn.Module, sequences: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], top_k: int
) -> torch.Tensor:
    """(K, top_k) measured P(head k's rank-r token is right), teacher-forced: the calibration of a Medusa static
    tree. `sequences` yields (last hidden states (T, d), token ids (T,), scored (T,) bool: the tokens that count as
    predictions, e.g. response tokens); head k at position t predicts token t + k + 1."""
    K = heads.cfg.num_heads
    hits, counts = torch.zeros(K, top_k), torch.zeros(K)
    for hidden, ids, scored in sequences:
        for k in range(1, K + 1):
            pos = torch.nonzero(scored[k + 1 :]).flatten()  # t such that token t + k + 1 is scored
            if pos.numel() == 0:
                continue
            top = heads.head(k, hidden[pos]).topk(top_k, dim=-1).indices.cpu()  # (n, top_k), one head at a time
            hits[k - 1] += (top == ids[pos + k + 1, None].cpu()).sum(0).float()
            counts[k - 1] += pos.numel()
    return hits / counts.clamp(min=1)[:, None]


def calibration_samples(
    recipe: Recipe, tokenizer, limit: int, prepared: list[dict] | None = None
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    """Token data to calibrate a Medusa tree on, never the eval prompts: (ids (T,), loss mask (T,) bool) of the
    training run's held-out samples (the ids it recorded in `<train.output_dir>/heldout.json`; for runs without
    that file the split re-created from `data.heldout_fraction` and `train.seed`), or of its first samples when it
    held none out; read from the feature shards when there are any (no tokenizing), else prepared from the recipe's
    data (`prepared`: the recipe's data already prepared by the caller). Returns (samples, description)."""
    data = recipe.data
    if data.features_dir is not None and (Path(data.features_dir) / "manifest.json").is_file():
        dataset = FeatureDataset(data.features_dir, verify_checksums=data.verify_checksums)
        sample_ids, source = dataset.sample_ids, f"the feature shards of {data.features_dir}"

        def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            item = dataset[i]
            return item["input_ids"], item["loss_mask"] > 0
    else:
        prepared = prepare_dataset(data, tokenizer).samples if prepared is None else prepared
        sample_ids, source = [s["id"] for s in prepared], "the recipe's data"

        def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tensor(prepared[i]["input_ids"]), torch.tensor(prepared[i]["loss_mask"]) > 0

    train_idx, heldout_idx = heldout_positions(recipe, sample_ids, source)
    chosen, which = (heldout_idx, "held-out") if heldout_idx else (train_idx, "training")
    chosen = sorted(chosen, key=lambda i: sample_ids[i])[:limit]  # by sample id: the same from shards or data
    samples = [sample(i) for i in chosen]
    return samples, f"{len(samples)} {which} samples of {source}"


def heldout_positions(recipe: Recipe, sample_ids: list, source: str) -> tuple[list[int], list[int]]:
    """(training, held-out) positions in `sample_ids`: the held-out ids the training run recorded, else (with a log
    line) the split re-created from the recipe, as training made it before runs recorded their split."""
    run_dir = recipe.train.output_dir
    recorded = read_heldout(run_dir)
    if recorded is None:
        print(
            f"eval: no {HELDOUT_FILE} in {run_dir}: re-creating the training run's held-out split from "
            f"data.heldout_fraction={recipe.data.heldout_fraction} and train.seed={recipe.train.seed}"
        )
        return split_by_id(sample_ids, recipe.data.heldout_fraction, recipe.train.seed)
    heldout = set(recorded)
    heldout_idx = [i for i, sample_id in enumerate(sample_ids) if sample_id in heldout]
    if recorded and not heldout_idx:
        raise EvalError(
            f"{Path(run_dir) / HELDOUT_FILE}: none of its {len(recorded)} held-out samples is in {source}: the run "
            "was trained on other data than the recipe names"
        )
    return [i for i, sample_id in enumerate(sample_ids) if sample_id not in heldout], heldout_idx


def calibration_sequences(target: Target, samples: list[tuple[torch.Tensor, torch.Tensor]]):
    """`medusa_rank_accuracy` input: the verifying target's last hidden states over each sample (for Medusa-2 the
    LoRA-merged backbone its heads read), its ids, and its loss tokens as the scored ones."""
    for ids, scored in samples:
        ids = ids.to(target.device)
        hidden = target.hidden_states(ids[None], layers=[-1])[0, :, 0].to(ids.device)  # device_map: last GPU
        yield hidden, ids, scored.to(ids.device)


def fit_data(recipe: Recipe, method: Method, target: Target, drafter: torch.nn.Module) -> FitData:
    """What the two-stage head's factors are fitted on when the export holds none: the feature shards of
    data.features_dir, or, for a drafter that adapts the target (Medusa-2, whose heads read the LoRA-merged
    backbone) or a run without shards, the verifying target's hidden states over the calibration samples, with the
    loss-token counts of the recipe's data."""
    data, vocab = recipe.data, target.config.vocab_size
    if not method.adapts_target and data.features_dir and (Path(data.features_dir) / "manifest.json").is_file():
        return shard_fit_data(FeatureDataset(data.features_dir, verify_checksums=data.verify_checksums), drafter, vocab)
    prepared = prepare_dataset(data, target.tokenizer).samples  # the counts' data, and the samples' without shards
    samples, desc = calibration_samples(recipe, target.tokenizer, CALIBRATION_SAMPLES, prepared)
    layers = list(drafter.stored_layers)
    fit = []
    for ids, scored in samples:
        hidden = target.hidden_states(ids[None].to(target.device), layers=layers)[0].cpu()  # (T, S, d)
        fit.append({"input_ids": ids, "hidden": hidden, "loss_mask": scored})
    counts = loss_token_counts(prepared, vocab_size=vocab)
    return fit, counts, f"the target's hidden states over {desc}"


def draft_window(ev: EvalConfig, config: dict[str, Any]) -> int | None:
    """`eval.draft_window` resolved: None for the whole context (0), else a number of positions; unset, the
    `data.max_len` of the recipe the export records (imports record none: the whole context)."""
    if ev.draft_window is not None:
        return ev.draft_window or None
    recorded = ((config.get("recipe") or {}).get("data") or {}).get("max_len")
    return recorded if isinstance(recorded, int) and recorded > 0 else None


def _export_asked(drafter_dir: str) -> int:
    """How many draft tokens the export was written asking for (`max(eval.draft_vocab, train.loss_vocab)` of the
    recipe it recorded; 0 when it recorded none)."""
    recorded = read_config(drafter_dir).get("recipe") or {}
    asked = [
        (recorded.get(section) or {}).get(key) or 0
        for section, key in (("eval", "draft_vocab"), ("train", "loss_vocab"))
    ]
    return max(asked)


def draft_vocabulary(recipe: Recipe, drafter_dir: str, size: int) -> torch.Tensor:
    """The `size` most frequent loss tokens of the training data: from the export's own draft vocabulary when it
    has that many tokens, or when it was written asking for at least that many (then the data has no more, and a
    line says so); else counted in the feature shards of data.features_dir without the training run's held-out
    samples (as training and export count), refusing more than they hold."""
    shipped = load_draft_vocab(drafter_dir)
    if shipped is not None and len(shipped) >= size:
        return shipped[:size]
    features = recipe.data.features_dir
    no_shards = features is None or not (Path(features) / "manifest.json").is_file()
    if shipped is not None and (no_shards or _export_asked(drafter_dir) >= size):
        # the export asked for at least this many: its training data has no more distinct loss tokens
        print(
            f"eval.draft_vocab: {size} asked, {len(shipped)} available: {drafter_dir} ships every distinct loss token "
            "of its training data; drafting among all of them"
        )
        return shipped
    if features is None or not (Path(features) / "manifest.json").is_file():
        have = f"{drafter_dir} ships {len(shipped)} draft tokens and n" if shipped is not None else "N"
        raise EvalError(
            f"{recipe.source}: eval.draft_vocab: {size}: {have}o feature shards at data.features_dir ({features}) "
            "to count the training data's tokens in"
        )
    dataset = FeatureDataset(features, verify_checksums=recipe.data.verify_checksums)
    skip = read_heldout(recipe.train.output_dir) or ()  # training chose its tokens without its held-out samples
    vocab = frequent_loss_tokens(dataset, size, skip)
    if len(vocab) < size:  # never shrink quietly: the report would describe a vocabulary the run did not use
        raise EvalError(
            f"{recipe.source}: eval.draft_vocab: {size} asked, {len(vocab)} available (the distinct loss tokens of "
            f"{features}); ask for at most {len(vocab)}, or 0 for the whole vocabulary"
        )
    return vocab


def medusa_calibration(heads: torch.nn.Module, target: Target, samples, top_k: int) -> torch.Tensor:
    """Medusa heads' per-depth rank accuracy on calibration samples ((ids, scored) pairs), from the target's last
    hidden states."""
    return medusa_rank_accuracy(heads, calibration_sequences(target, samples), top_k)
