"""Acceptance-length evaluation: speculative decoding against plain decoding and prompt lookup, same prompts, same run.

    python -m eval RECIPE [key=value ...]
    accelerate launch -m eval RECIPE [key=value ...]

Loads the recipe's target and the exported drafter (`eval.drafter`, default `<train.output_dir>/export`),
reads `eval.prompts` (JSONL: chat records with `messages` / `conversations`, rendered with the chat
template up to the first assistant turn plus the generation prompt, or plain `prompt` records), splits
them across processes and, for every prompt, decodes with
- plain decoding (own KV-cached loop, one target forward per token; for batches, left-padded batched decoding
  with the model's own attention, as HF batched generation),
- speculative decoding with the drafter (`eval/generate.py`; tree per `eval.tree`),
- transformers' prompt-lookup decoding (`generate(prompt_lookup_num_tokens=10)`): what a user gets
  without training a drafter.
With `eval.batch_size: B` the speculative and plain runs decode B prompts at a time (speeds are batch
throughputs; prompt lookup decodes one prompt at a time, so recipes with B > 1 are refused unless
`eval.baselines` leaves it out). Decoding stops at the target's EOS tokens (and
`<|end|>` where the vocabulary has it) or after `eval.max_new_tokens`. Greedy speculative output is
checked against plain greedy output token for token.
Process 0 writes `report.json`, `report.md` and `report.png` to `eval.output_dir` (default
`<train.output_dir>/eval`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import yaml

from data.chat import SHAREGPT_ROLES, ChatTemplateError, DataError
from data.prepare import prepare_dataset, read_jsonl
from data.shards import FeatureDataset, FeatureMismatchError, frequent_loss_tokens, split_by_id
from eval.checks import near_tie, tie_margin
from eval.generate import (
    DecodeSettings,
    EagleProposer,
    GenerationResult,
    MedusaProposer,
    Proposer,
    clock,
    plain_generate,
    plain_generate_batch,
    speculative_generate,
    speculative_generate_batch,
)
from eval.report import summarize, write_report
from eval.trees import NAMED_TREES, calibrated_tree, chain, medusa_tree
from models.eagle import EagleDrafter
from models.io import ExportError, load_draft_vocab, load_drafter, read_config
from models.medusa import MedusaHeads
from models.target import Target, TargetError, load_target
from train.config import EvalConfig, Recipe, RecipeError, load_recipe

PROMPT_LOOKUP_TOKENS = 10
CALIBRATION_SAMPLES = 64
WARMUP_TOKENS = 4
END_OF_TURN = "<|end|>"


class EvalError(ValueError):
    """Bad eval input (prompts file, drafter, tree); the message names the file / key."""


# --------------------------------------------------------------------------------------------
# Prompts


def prompt_token_ids(record: dict[str, Any], tokenizer, where: str) -> list[int]:
    """A chat record (up to its first assistant turn, plus the generation prompt) or a plain `prompt` -> ids."""
    if not isinstance(record, dict):
        raise EvalError(f"{where}: a prompt record must be a JSON object, got {type(record).__name__}")
    turns = record.get("messages") or record.get("conversations")
    if turns is not None:
        if not isinstance(turns, list):
            raise EvalError(f"{where}: `messages` / `conversations` must be a list of turns")
        messages = []
        for turn in turns:
            if not isinstance(turn, dict):
                raise EvalError(f"{where}: a turn must be a JSON object, got {turn!r:.80}")
            role = SHAREGPT_ROLES.get(turn.get("role", turn.get("from")))
            if role is None:
                raise EvalError(f"{where}: unknown role in turn {turn!r:.80}")
            if role == "assistant":
                break
            messages.append({"role": role, "content": turn.get("content", turn.get("value"))})
        if not messages:
            raise EvalError(f"{where}: no user turn before the first assistant turn")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(record.get("prompt"), str):
        ids = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        bos = tokenizer.bos_token_id
        return ([bos] if bos is not None and ids[:1] != [bos] else []) + ids
    raise EvalError(f"{where}: needs `messages`, `conversations` or a string `prompt`")


def load_prompts(path: str, tokenizer, limit: int | None) -> list[dict[str, Any]]:
    """[{index, id, input_ids}] from a JSONL file; errors name file:line."""
    if not Path(path).is_file():
        raise EvalError(f"eval.prompts: no such file {path}")
    prompts = []
    for where, record in read_jsonl(path):
        if limit is not None and len(prompts) >= limit:
            break
        if isinstance(record, DataError):  # a line that is not JSON
            raise EvalError(str(record))
        ids = prompt_token_ids(record, tokenizer, where)
        group = record.get("category", record.get("kind"))  # MT-bench's categories, the SmolLM2 sets' kinds
        prompts.append({"index": len(prompts), "id": str(record.get("id", where)), "input_ids": ids, "group": group})
    if not prompts:
        raise EvalError(f"{path}: no prompts")
    return prompts


def stop_token_ids(target: Target) -> list[int]:
    """Where decoding stops: the target's EOS tokens, the tokenizer's, and `<|end|>` where the vocabulary has it
    (chat turns end there, as in data.selfdistill)."""
    eos = target.model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    stops = [target.tokenizer.eos_token_id]
    if END_OF_TURN in target.tokenizer.get_vocab():
        stops.append(target.tokenizer.convert_tokens_to_ids(END_OF_TURN))
    return eos + [t for t in stops if t is not None and t not in eos]


# --------------------------------------------------------------------------------------------
# Drafter -> proposer


@torch.inference_mode()
def medusa_rank_accuracy(
    heads: MedusaHeads, sequences: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], top_k: int
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


def calibration_samples(recipe: Recipe, tokenizer, limit: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    """Token data to calibrate a Medusa tree on, never the eval prompts: (ids (T,), loss mask (T,) bool) of the
    training run's held-out samples (same `data.heldout_fraction` and `train.seed`), or of its first samples when
    it held none out; read from the feature shards when there are any (no tokenizing), else prepared from the
    recipe's data. Returns (samples, description)."""
    data = recipe.data
    if data.features_dir is not None and (Path(data.features_dir) / "manifest.json").is_file():
        dataset = FeatureDataset(data.features_dir, verify_checksums=data.verify_checksums)
        sample_ids, source = dataset.sample_ids, f"the feature shards of {data.features_dir}"

        def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            item = dataset[i]
            return item["input_ids"], item["loss_mask"] > 0
    else:
        prepared = prepare_dataset(data, tokenizer).samples
        sample_ids, source = [s["id"] for s in prepared], "the recipe's data"

        def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tensor(prepared[i]["input_ids"]), torch.tensor(prepared[i]["loss_mask"]) > 0

    train_idx, heldout_idx = split_by_id(sample_ids, data.heldout_fraction, recipe.train.seed)
    chosen, which = (heldout_idx, "held-out") if heldout_idx else (train_idx, "training")
    chosen = sorted(chosen, key=lambda i: sample_ids[i])[:limit]  # by sample id: the same from shards or data
    samples = [sample(i) for i in chosen]
    return samples, f"{len(samples)} {which} samples of {source}"


def calibration_sequences(target: Target, samples: list[tuple[torch.Tensor, torch.Tensor]]):
    """`medusa_rank_accuracy` input: the verifying target's last hidden states over each sample (for Medusa-2 the
    LoRA-merged backbone its heads read), its ids, and its loss tokens as the scored ones."""
    for ids, scored in samples:
        ids = ids.to(target.device)
        hidden = target.hidden_states(ids[None], layers=[-1])[0, :, 0].to(ids.device)  # device_map: last GPU
        yield hidden, ids, scored.to(ids.device)


def draft_vocabulary(recipe: Recipe, drafter_dir: str, size: int) -> torch.Tensor:
    """The `size` most frequent loss tokens of the training data: from the export's own draft vocabulary when it
    has one with that many tokens (shipped drafters), else counted in the feature shards of data.features_dir."""
    shipped = load_draft_vocab(drafter_dir)
    if shipped is not None and len(shipped) >= size:
        return shipped[:size]
    features = recipe.data.features_dir
    if shipped is not None and (features is None or not (Path(features) / "manifest.json").is_file()):
        # the export was written asking for at least this many: its training data had no more distinct tokens
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
    vocab = frequent_loss_tokens(FeatureDataset(features, verify_checksums=recipe.data.verify_checksums), size)
    if len(vocab) < size:  # never shrink quietly: the report would describe a vocabulary the run did not use
        raise EvalError(
            f"{recipe.source}: eval.draft_vocab: {size} asked, {len(vocab)} available (the distinct loss tokens of "
            f"{features}); ask for at most {len(vocab)}, or 0 for the whole vocabulary"
        )
    return vocab


def build_proposer(
    drafter: torch.nn.Module, ev: EvalConfig, calibrate, draft_vocab: torch.Tensor | None = None
) -> tuple[Proposer, str]:
    """The proposer for `drafter` and `eval.tree`, with a short description of the tree for the report.

    `calibrate(top_k)` returns measured Medusa rank accuracies (only called for calibrated trees); `draft_vocab`
    restricts drafting to those token ids.
    """
    tree, vocab = ev.tree, draft_vocab
    suffix = "" if vocab is None else f", draft vocab {len(vocab)}"
    if isinstance(drafter, EagleDrafter):
        if tree in ("auto", "dynamic"):
            desc = f"dynamic d{ev.tree_depth} k{ev.tree_top_k} n{ev.tree_total_tokens}{suffix}"
            return EagleProposer(drafter, ev.tree_depth, ev.tree_top_k, ev.tree_total_tokens, vocab), desc
        if tree == "chain":
            return EagleProposer(drafter, ev.tree_depth, 1, ev.tree_depth + 1, vocab), f"chain d{ev.tree_depth}{suffix}"
        raise EvalError(f"eval.tree: {tree!r} is not an EAGLE tree (auto, dynamic, chain)")
    if isinstance(drafter, MedusaHeads):
        heads = drafter.cfg.num_heads
        if tree == "chain":
            depth = min(ev.tree_depth, heads)
            return MedusaProposer(drafter, chain(depth), vocab), f"chain d{depth}{suffix}"
        if tree in NAMED_TREES:
            return MedusaProposer(drafter, medusa_tree(NAMED_TREES[tree], heads), vocab), f"{tree}{suffix}"
        if tree in ("auto", "calibrated"):
            depth = min(ev.tree_depth, heads)
            rank_acc = calibrate(ev.tree_top_k)[:depth]
            static = calibrated_tree(rank_acc, ev.tree_total_tokens - 1)
            desc = f"calibrated d{static.max_depth} n{static.num_nodes}{suffix}"
            return MedusaProposer(drafter, static, vocab), desc
        raise EvalError(
            f"eval.tree: {tree!r} is not a Medusa tree (auto, calibrated, mc_sim_7b_63, calibrated63, chain)"
        )
    raise EvalError(f"no proposer for drafter type {type(drafter).__name__}")


# --------------------------------------------------------------------------------------------
# One prompt, three decoders


@torch.inference_mode()
def hf_generate(
    model, ids: torch.Tensor, settings: DecodeSettings, prompt_lookup: bool = False
) -> tuple[list[int], float]:
    """transformers' own `generate` on one prompt: plain decoding (the baseline the speculative output is checked
    against, sharing no code with the speculative loop), or prompt-lookup decoding (n-gram drafts copied from the
    context). -> (new tokens, the stop token included, seconds)."""
    kwargs: dict[str, Any] = {"do_sample": False}
    if not settings.greedy:
        kwargs = {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0}
        torch.manual_seed(settings.seed)
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    start = clock(ids.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=settings.eos_token_ids or None,
        pad_token_id=(settings.eos_token_ids or [0])[0],
        **kwargs,
    )
    return out[0, ids.shape[1] :].tolist(), clock(ids.device) - start


def evaluate_batch(
    target: Target, proposer: Proposer, prompts: list[dict[str, Any]], settings: DecodeSettings, ev: EvalConfig
) -> list[dict[str, Any]]:
    """Decode a batch of prompts together (`eval.batch_size` > 1) with the speculative and the batched plain loop; one
    record per prompt, as `evaluate_prompt` writes, plus the size of the batch it ran in (a last batch may be smaller).

    Prompt i samples with seed `eval.seed + i` in both loops, as at batch size 1, so outputs do not depend on the
    batching. A row's `wall_s` is its share (1 / B) of its batch's wall time, so pooled speeds are batch
    throughputs."""
    if ev.batch_size == 1:
        return [evaluate_prompt(target, proposer, prompts[0], settings, ev)]
    ids = [torch.tensor(p["input_ids"], device=target.device) for p in prompts]
    seeds = [ev.seed + p["index"] for p in prompts]
    share = 1 / len(prompts)
    specs = speculative_generate_batch(target.model, proposer, ids, settings, ev.kernels, seeds=seeds)
    plains = plain_generate_batch(target.model, ids, settings, seeds) if "plain" in ev.baselines else None
    records = []
    for row, (prompt, spec) in enumerate(zip(prompts, specs)):
        spec.wall_s, spec.target_s, spec.draft_s = spec.wall_s * share, spec.target_s * share, spec.draft_s * share
        record = _record(target, prompt, spec) | {"batch_size": len(prompts)}
        if plains is not None:
            _compare_plain(record, spec.tokens, plains[row].tokens, plains[row].wall_s * share, settings)
            if record["lossless"] is False:  # the batched baseline's numerics (padding mask) may break a near-tie:
                alone = plain_generate(target.model, ids[row][None], dataclasses.replace(settings, seed=seeds[row]))
                _compare_plain(record, spec.tokens, alone.tokens, record["plain"]["wall_s"], settings)
                record["lossless_baseline"] = "plain decoding of the prompt alone (the batched plain output differed)"
                _judge_mismatch(record, target, prompt["input_ids"], spec.tokens, alone.tokens, ev)
        records.append(record)
    return records


def _record(target: Target, prompt: dict[str, Any], spec: GenerationResult) -> dict[str, Any]:
    return {
        "index": prompt["index"],
        "id": prompt["id"],
        "prompt_tokens": len(prompt["input_ids"]),
        "group": prompt.get("group"),
        "speculative": spec.stats()
        | {
            "accepted": spec.accepted,
            "tree_depth": spec.tree_depth,
            "extendable": spec.extendable,
            "target_s": spec.target_s,
            "draft_s": spec.draft_s,
        },
        "output": target.tokenizer.decode(spec.tokens) if target.tokenizer is not None else None,
        "lossless": None,
    }


def _compare_plain(
    record: dict[str, Any], spec: list[int], plain: list[int], wall_s: float, settings: DecodeSettings
) -> None:
    record["plain"] = {"new_tokens": len(plain), "wall_s": wall_s}
    if settings.greedy:
        record["lossless"] = spec == plain
        mismatch = [i for i, (a, b) in enumerate(zip(spec, plain)) if a != b]
        record["first_mismatch"] = mismatch[0] if mismatch else None


def evaluate_prompt(
    target: Target, proposer: Proposer, prompt: dict[str, Any], settings: DecodeSettings, ev: EvalConfig
) -> dict[str, Any]:
    """Decode one prompt with every method; the per-prompt record of the report."""
    device = target.device
    ids = torch.tensor([prompt["input_ids"]], device=device)
    settings = dataclasses.replace(settings, seed=ev.seed + prompt["index"])
    spec = speculative_generate(target.model, proposer, ids, settings, ev.kernels)
    record = _record(target, prompt, spec)
    if "plain" in ev.baselines:
        tokens, seconds = hf_generate(target.model, ids, settings)
        _compare_plain(record, spec.tokens, tokens, seconds, settings)
        _judge_mismatch(record, target, prompt["input_ids"], spec.tokens, tokens, ev)
    if "prompt_lookup" in ev.baselines:
        tokens, seconds = hf_generate(target.model, ids, settings, prompt_lookup=True)
        record["prompt_lookup"] = {"new_tokens": len(tokens), "wall_s": seconds}
    return record


def _judge_mismatch(
    record: dict[str, Any], target: Target, prompt: list[int], spec: list[int], plain: list[int], ev: EvalConfig
) -> None:
    """A greedy output that differs from plain decoding is a failure, unless the first differing position is a
    near-tie of the target (`eval.checks.near_tie`): then both tokens are the target's own greedy choice up to
    rounding, the prompt counts as lossless, and the record says where and by how much."""
    if record["lossless"] is not False or record["first_mismatch"] is None:
        return
    i = record["first_mismatch"]
    tie = near_tie(target.model, prompt + plain[:i], spec[i], plain[i], tie_margin(ev, target))
    record["near_tie"] = tie
    record["lossless"] = tie["tie"]


# --------------------------------------------------------------------------------------------
# Entry


def process_gpus(local_index: int, num_local_processes: int, num_gpus: int) -> list[int]:
    """The GPUs one eval process spreads a `device_map` target over: an equal, disjoint share of the node's.

    No GPUs (CPU runs) gives []; fewer GPUs than processes is an error, since shares would overlap.
    """
    if num_gpus == 0:
        return []
    if num_gpus < num_local_processes:
        raise EvalError(
            f"target.device_map: {num_local_processes} processes on a node with {num_gpus} GPUs; "
            "launch at most one process per GPU (`accelerate launch --num_processes N`)"
        )
    share = num_gpus // num_local_processes
    return list(range(local_index * share, (local_index + 1) * share))


def drafter_directory(recipe: dict[str, Any]) -> str:
    """The export a recipe (as a dict) evaluates: `eval.drafter`, else `export.out`, else <train.output_dir>/export."""
    return recipe["eval"]["drafter"] or recipe["export"]["out"] or str(Path(recipe["train"]["output_dir"]) / "export")


REPORT_FILES = ("report.json", "report.md", "report.png", "recipe.yaml")
"""What an evaluation writes to its output directory (recipe.yaml: the settings it ran with)."""


def _settings(recipe: dict[str, Any]) -> dict[str, Any]:
    """The flat (dotted keys) settings a report depends on: target, data, drafter and eval sections, the evaluated
    export's resolved directory instead of eval.drafter, and not eval.output_dir (where the report goes)."""
    flat: dict[str, Any] = {}

    def walk(value: Any, key: str) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        else:
            flat[key] = value

    for section in ("target", "data", "drafter", "eval"):
        walk(recipe.get(section) or {}, section)
    flat.pop("eval.output_dir", None)
    flat.pop("data.verify_checksums", None)  # a check, not a setting
    flat["eval.drafter"] = str(Path(drafter_directory(recipe)).resolve())
    return flat


def check_output_dir(recipe: Recipe, out_dir: str) -> None:
    """Refuse an `eval.output_dir` that holds a report made with other settings, as training refuses an output_dir
    that holds checkpoints: the new report would silently replace a measurement of something else. A report made
    with the same settings (its recipe.yaml) is replaced."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise EvalError(f"{recipe.source}: eval.output_dir: {out_dir} is a file, not a directory")
    found = [name for name in REPORT_FILES if (out / name).exists()]
    if not found:
        return
    try:
        before = _settings(yaml.safe_load((out / "recipe.yaml").read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError, KeyError, TypeError):
        before = None  # no recipe.yaml, or not one an evaluation wrote
    fix = f"choose another eval.output_dir, or delete {out_dir} to replace its report"
    if before is None:
        raise EvalError(
            f"{out_dir} holds {found[0]} of an evaluation with unknown settings (no readable recipe.yaml): {fix}"
        )
    now = _settings(yaml.safe_load(yaml.safe_dump(recipe.to_dict(), sort_keys=False)))
    changed = next((k for k in sorted(before.keys() | now.keys()) if before.get(k) != now.get(k)), None)
    if changed is not None:
        raise EvalError(
            f"{out_dir} holds a report made with other settings ({changed}: {before.get(changed)!r:.60} there, "
            f"{now.get(changed)!r:.60} in {recipe.source}): {fix}"
        )


def run(recipe: Recipe) -> dict[str, Any] | None:
    """Evaluate; returns the summary on the main process (None on the others)."""
    from accelerate import PartialState
    from accelerate.utils import gather_object, parse_flag_from_env
    from tqdm import tqdm

    ev = recipe.eval
    if ev.prompts is None:
        raise EvalError(f"{recipe.source}: eval.prompts: is required (a JSONL file of prompts)")
    drafter_dir = drafter_directory(recipe.to_dict())
    out_dir = ev.output_dir or str(Path(recipe.train.output_dir) / "eval")
    exported = read_config(drafter_dir)["method"]  # before any heavy work: the export exists and is a drafter
    if exported != recipe.drafter.method:
        method = recipe.drafter.method
        raise EvalError(
            f"{Path(drafter_dir) / 'config.json'}: method: the export holds a {exported} drafter, {recipe.source} has "
            f"drafter.method={method}; evaluate it with a {exported} recipe, or point eval.drafter at an export of a "
            f"{method} drafter"
        )
    check_output_dir(recipe, out_dir)
    # on CPU-only machines (or ACCELERATE_USE_CPU) processes talk gloo: `accelerate launch --multi_gpu` there
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
    if recipe.target.device_map is None:
        target = load_target(**dataclasses.asdict(recipe.target))
        target.model.to(state.device)
    else:  # a target too large for one GPU: this process's share of the node's GPUs
        local = int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))  # processes on this node
        gpus = process_gpus(state.local_process_index, local, torch.cuda.device_count())
        memory = {g: torch.cuda.get_device_properties(g).total_memory for g in gpus} if gpus else None
        target = load_target(**dataclasses.asdict(recipe.target) | {"max_memory": memory})
    if target.tokenizer is None:
        raise EvalError(f"{recipe.source}: target.tokenizer: the target has no tokenizer to render prompts")
    drafter = load_drafter(drafter_dir, target)
    target_desc = target.name
    if hasattr(drafter, "adapt_target"):  # Medusa-2: the LoRA-merged target verifies, and is the baseline too
        drafter = drafter.adapt_target(target)
        target_desc += f" + {recipe.drafter.method} LoRA (merged)"
    prompts = load_prompts(ev.prompts, target.tokenizer, ev.max_prompts)
    eos = stop_token_ids(target)
    settings = DecodeSettings(
        max_new_tokens=ev.max_new_tokens,
        temperature=ev.temperature,
        top_p=ev.top_p,
        acceptance=ev.acceptance,
        typical_epsilon=ev.typical_epsilon,
        typical_delta=ev.typical_delta,
        eos_token_ids=eos,
        seed=ev.seed,
    )

    calibration: list[str] = []  # what the calibrated tree was measured on, for the report

    def calibrate(top_k: int) -> torch.Tensor:
        """Every process measures the same data, so every process builds the same tree."""
        samples, desc = calibration_samples(recipe, target.tokenizer, CALIBRATION_SAMPLES)
        calibration.append(desc)
        return medusa_rank_accuracy(drafter, calibration_sequences(target, samples), top_k)

    draft_vocab = None
    if ev.draft_vocab:
        draft_vocab = draft_vocabulary(recipe, drafter_dir, ev.draft_vocab).to(target.device)
    try:
        proposer, tree_desc = build_proposer(drafter, ev, calibrate, draft_vocab)
    except EvalError:
        raise
    except ValueError as exc:  # e.g. a calibrated tree deeper than the heads
        raise EvalError(f"{recipe.source}: eval: {exc}") from None
    with state.split_between_processes(prompts) as local:
        batches = [local[i : i + ev.batch_size] for i in range(0, len(local), ev.batch_size)]
        if batches:  # warm-up (kernel compilation, allocator), not timed
            warm = dataclasses.replace(settings, max_new_tokens=WARMUP_TOKENS)
            evaluate_batch(target, proposer, batches[0], warm, ev)
        bar = tqdm(total=len(local), desc=f"eval {recipe.drafter.method}", disable=not state.is_local_main_process)
        records = []
        for batch in batches:
            records += evaluate_batch(target, proposer, batch, settings, ev)
            bar.update(len(batch))
        bar.close()
    if state.num_processes > 1:
        records = gather_object(records)
    if not state.is_main_process:
        return None
    meta = {
        "method": recipe.drafter.method,
        "tree": tree_desc,
        "target": target_desc,
        "drafter": drafter_dir,
        "prompts": ev.prompts,
        "max_new_tokens": ev.max_new_tokens,
        "temperature": ev.temperature,
        "top_p": ev.top_p,
        "acceptance": ev.acceptance,
        "kernels": ev.kernels,
        "device": str(target.device),
        "num_processes": state.num_processes,
        "batch_size": ev.batch_size,
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
        "tree_calibration": calibration[0] if calibration else None,
    }
    summary = summarize(records, meta)
    write_report(summary, out_dir)
    recipe.save(Path(out_dir) / "recipe.yaml")
    return summary


INPUT_ERRORS = (RecipeError, EvalError, ExportError, TargetError, DataError, ChatTemplateError, FeatureMismatchError)
"""Bad input, reported as one line (`error: ...`) and a non-zero exit."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides, inputs=("target.path", "target.tokenizer", "eval.prompts"))
        summary = run(recipe)
    except INPUT_ERRORS as exc:
        sys.exit(f"error: {exc}")
    if summary is not None:
        out = recipe.eval.output_dir or str(Path(recipe.train.output_dir) / "eval")
        fmt = lambda key, spec, unit="": "n/a" if summary[key] is None else format(summary[key], spec) + unit
        print(
            f"eval/accept_len {fmt('accept_len', '.3f')}  speedup vs plain {fmt('speedup_vs_plain', '.2f', 'x')}  "
            f"vs prompt lookup {fmt('speedup_vs_prompt_lookup', '.2f', 'x')}  lossless {summary['lossless_prompts']}"
            f"  -> {out}/report.md"
        )


if __name__ == "__main__":
    main()
