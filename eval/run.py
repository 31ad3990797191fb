"""An evaluation run: speculative decoding against plain decoding and prompt lookup, same prompts, same run.

    recipe = load_recipe("recipes/pocket/eagle2.yaml", ["eval.max_prompts=4"])
    summary = run(recipe)                                   # what `python -m eval` runs; None off process 0
    print(summary_line(summary, output_dir(recipe)))

Loads the recipe's target and the exported drafter (`eval.drafter`, else `export.out`, else
`<train.output_dir>/export`) and builds its proposer (a calibrated Medusa tree is measured on the training run's
held-out samples: `eval.calibration`), reads `eval.prompts` (`eval/prompts.py`: chat records rendered with the
chat template up to the first assistant turn, or plain `prompt` records), checks `eval.output_dir`, splits the
prompts across processes and decodes them `eval.batch_size` at a time (`evaluate_batch`, every batch size) with
- speculative decoding with the drafter (`eval.decode`; proposer and tree per `eval.tree`, `eval.proposers`),
- plain decoding (`eval.baselines.plain_generate_batch`: left-padded batched decoding with the model's own
  attention, as HF batched generation; none of the speculative loop's code),
- transformers' prompt-lookup decoding (`generate(prompt_lookup_num_tokens=10)`, one prompt at a time): what a
  user gets without training a drafter.
Speeds of batches are batch throughputs; prompt lookup decodes one prompt at a time, so recipes with B > 1 are
refused unless `eval.baselines` leaves it out. Decoding stops at the target's EOS tokens (and `<|end|>` where the
vocabulary has it) or after `eval.max_new_tokens`. Greedy speculative output is checked against plain greedy output
token for token. Process 0 writes `report.json`, `report.md` and `report.png` to `eval.output_dir` (default
`<train.output_dir>/eval`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import yaml

from data.chat import ChatTemplateError, DataError
from data.heldout import HeldoutError
from data.shards import FeatureMismatchError
from eval import REPORT_FILES, EvalError, kernels
from eval.baselines import PROMPT_LOOKUP_TOKENS, plain_generate, plain_generate_batch, prompt_lookup_generate
from eval.calibration import (
    CALIBRATION_SAMPLES,
    calibration_samples,
    draft_vocabulary,
    draft_window,
    fit_data,
)
from eval.checks import BOUNDARY_TOLERANCE, near_boundary, near_tie, tie_margin
from eval.costs import measure_costs
from eval.decode import DecodeSettings, GenerationResult, PositionCoins, rounds_in_loop, speculative_generate_batch
from eval.heads import two_stage_projections
from eval.lookup import LookupProposer
from eval.prompts import load_conversations, load_prompts, stop_token_ids
from eval.proposal import Proposer
from eval.proposers import build_proposer
from eval.report import summarize, write_report
from eval.target_runner import sliding_window
from methods import METHODS, resolve
from models.host import keep_freed_memory
from models.io import ExportError, load_drafter, read_config
from models.target import Target, TargetError, load_placed_target
from rundir.checkpoints import latest_checkpoint, read_state
from rundir.lock import lock_for_all
from schema.evaluation import EvalConfig
from schema.recipe import Recipe, RecipeError, dotted_settings, later_settings

WARMUP_TOKENS = 4

INPUT_ERRORS = (
    RecipeError,
    EvalError,
    ExportError,
    TargetError,
    DataError,
    ChatTemplateError,
    FeatureMismatchError,
    HeldoutError,
)
"""Bad input, reported as one line (`error: ...`) and a non-zero exit by `python -m eval`."""


# --------------------------------------------------------------------------------------------
# One batch of prompts, three decoders


def evaluate_batch(
    target: Target, proposer: Proposer, prompts: list[dict[str, Any]], settings: DecodeSettings, ev: EvalConfig
) -> list[dict[str, Any]]:
    """Decode a batch of prompts (any size, 1 included) with every method; one record per prompt, the per-prompt
    records of the report, with the size of the batch it ran in when `eval.batch_size` > 1 (a last batch may be
    smaller).

    Speculative and plain decoding run the batch together; prompt i samples with seed `eval.seed + i` in both, so
    outputs do not depend on the batching. A row's `wall_s` is its share (1 / B) of its batch's wall time, so pooled
    speeds are batch throughputs. Prompt lookup decodes one prompt at a time (batch size 1 only, see EvalConfig)."""
    ids = [torch.tensor(p["input_ids"], device=target.device) for p in prompts]
    seeds = [ev.seed + p["index"] for p in prompts]
    share = 1 / len(prompts)
    specs = speculative_generate_batch(target.model, proposer, ids, settings, ev.kernels, seeds=seeds)
    plains = plain_generate_batch(target.model, ids, settings, seeds) if "plain" in ev.baselines else None
    records = []
    for row, (prompt, spec) in enumerate(zip(prompts, specs)):
        spec.wall_s, spec.target_s, spec.draft_s = spec.wall_s * share, spec.target_s * share, spec.draft_s * share
        batched = {"batch_size": len(prompts), "batch": prompts[0]["index"]} if ev.batch_size > 1 else {}
        record = _record(target, prompt, spec) | batched
        row_settings = dataclasses.replace(settings, seed=seeds[row])
        if plains is not None:
            plain = plains[row].tokens
            record["plain"] = {"new_tokens": len(plain), "wall_s": plains[row].wall_s * share}  # the speed baseline
            _compare_plain(record, spec.tokens, plain, settings)
            if record["lossless"] is False and len(prompts) > 1:  # the padding mask may break a near-tie:
                plain = plain_generate(target.model, ids[row][None], row_settings).tokens  # the prompt alone
                _compare_plain(record, spec.tokens, plain, settings)
                record["lossless_baseline"] = "plain decoding of the prompt alone (the batched plain output differed)"
            _judge_mismatch(record, target, prompt["input_ids"], spec.tokens, plain, ev, row_settings)
        if "prompt_lookup" in ev.baselines:
            tokens, seconds = prompt_lookup_generate(target.model, ids[row][None], row_settings)
            record["prompt_lookup"] = {"new_tokens": len(tokens), "wall_s": seconds}
        records.append(record)
    return records


def _record(target: Target, prompt: dict[str, Any], spec: GenerationResult) -> dict[str, Any]:
    return {
        "index": prompt["index"],
        "id": prompt["id"],
        "prompt_tokens": len(prompt["input_ids"]),
        "group": prompt.get("group"),
        **({"context": prompt["context"]} if "context" in prompt else {}),
        "speculative": spec.stats()
        | {
            "accepted": spec.accepted,
            "tree_depth": spec.tree_depth,
            "tree_nodes": spec.tree_nodes,
            "round_s": spec.round_s,
            "extendable": spec.extendable,
            "in_loop": rounds_in_loop(spec.tokens, spec.accepted),
            "target_s": spec.target_s,
            "draft_s": spec.draft_s,
        },
        "output": target.tokenizer.decode(spec.tokens) if target.tokenizer is not None else None,
        "lossless": None,
    }


def _compare_plain(record: dict[str, Any], spec: list[int], plain: list[int], settings: DecodeSettings) -> None:
    """Whether the speculative output is plain decoding's (greedy, or sampled with the same coin at each output
    position), and where they first differ. Typical acceptance is lossy by design: not compared."""
    if settings.greedy or settings.acceptance != "typical":
        record["lossless"] = spec == plain
        mismatch = [i for i, (a, b) in enumerate(zip(spec, plain)) if a != b]
        if not mismatch and len(spec) != len(plain):
            mismatch = [min(len(spec), len(plain))]
        record["first_mismatch"] = mismatch[0] if mismatch else None


def _judge_mismatch(
    record: dict[str, Any],
    target: Target,
    prompt: list[int],
    spec: list[int],
    plain: list[int],
    ev: EvalConfig,
    settings: DecodeSettings,
) -> None:
    """A greedy output that differs from plain decoding is a failure, unless every differing position is a near-tie
    of the target (`eval.checks.near_tie`). After a tie the two outputs go separate ways, so the rest of the
    speculative output is compared with plain greedy decoding continued from its own tokens up to the tie, and so on
    to its end. The prompt counts as lossless only if every divergence is a tie; the record says where the first one
    is and by how much (`near_tie`), and lists the later ones (`later_ties`)."""
    if record["lossless"] is not False or record["first_mismatch"] is None:
        return
    i = record["first_mismatch"]
    if not settings.greedy:  # the first divergence only: after it the two outputs draw on different prefixes
        if i >= min(len(spec), len(plain)):
            return
        coin = float(PositionCoins([settings.seed], settings, target.device).at([0], [i])[0])
        tolerance = 1e-6 if target.dtype == torch.float32 else BOUNDARY_TOLERANCE
        tie = near_boundary(target.model, prompt + spec[:i], spec[i], plain[i], coin, settings, tolerance)
        record["near_tie"], record["later_ties"], record["lossless"] = tie | {"position": i}, [], tie["tie"]
        return
    margin, ties = tie_margin(ev, target), []
    i, reference, start = record["first_mismatch"], plain, 0  # reference[k - start]: plain greedy's token k
    while True:
        tie = near_tie(target.model, prompt + spec[:i], spec[i], reference[i - start], margin)
        ties.append(tie | {"position": i})
        rest = spec[i + 1 :]
        if not tie["tie"] or not rest:
            break
        prefix = torch.tensor([prompt + spec[: i + 1]], device=target.device)
        more = plain_generate(target.model, prefix, dataclasses.replace(settings, max_new_tokens=len(rest))).tokens
        # both stop at the same EOS or at len(rest) tokens: equal tokens mean equal outputs
        j = next((k for k, (a, b) in enumerate(zip(rest, more)) if a != b), None)
        if j is None:
            break
        i, reference, start = i + 1 + j, more, i + 1
    record["near_tie"] = ties[0]
    record["later_ties"] = ties[1:]
    record["lossless"] = all(t["tie"] for t in ties)
    if not record["lossless"]:
        record["first_mismatch"] = next(t["position"] for t in ties if not t["tie"])


# --------------------------------------------------------------------------------------------
# Entry


def drafter_directory(recipe: dict[str, Any]) -> str:
    """The export a recipe (as a dict) evaluates: `eval.drafter`, else `export.out`, else <train.output_dir>/export."""
    return recipe["eval"]["drafter"] or recipe["export"]["out"] or str(Path(recipe["train"]["output_dir"]) / "export")


def _settings(recipe: dict[str, Any]) -> dict[str, Any]:
    """The flat (dotted keys) settings a report depends on: target, data, drafter and eval sections, the evaluated
    export's resolved directory instead of eval.drafter, and not eval.output_dir (where the report goes)."""
    flat = dotted_settings(recipe, ("target", "data", "drafter", "eval"))
    for section, fields in later_settings(recipe["drafter"]["method"]).items():  # a report made before them
        for key, earlier in fields.items():
            flat.setdefault(f"{section}.{key}", earlier)
    flat.pop("eval.output_dir", None)
    flat.pop("data.verify_checksums", None)  # a check, not a setting
    flat["eval.drafter"] = str(Path(drafter_directory(recipe)).resolve())
    return flat


def check_export_is_current(recipe: Recipe, drafter_dir: str, config: dict[str, Any]) -> None:
    """Refuse the run's export when the run has trained on since it was made: evaluating it would measure an older
    drafter under the run's name. Exports that record no step (older ones, imports) are taken as they are."""
    exported = config.get("trained_steps")
    newest = latest_checkpoint(recipe.train.output_dir)  # None without checkpoints (or without the directory)
    if not isinstance(exported, int) or newest is None:
        return
    trained = read_state(newest)["step"]
    if trained > exported:
        run = recipe.train.output_dir
        raise EvalError(
            f"{drafter_dir}: exported at step {exported}, but {run} has trained on to step {trained}: re-export "
            f"(python -m export {run}), or set eval.drafter={drafter_dir} to evaluate this export as it is"
        )


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


def output_dir(recipe: Recipe) -> str:
    """Where a recipe's report goes: `eval.output_dir`, else <train.output_dir>/eval."""
    return recipe.eval.output_dir or str(Path(recipe.train.output_dir) / "eval")


def kernels_backend(kind: str, device: torch.device) -> str:
    """What ran the tree kernels, for the report: the GPU's name, the Triton interpreter (turned on by `python -m
    eval` when there is no GPU), or the PyTorch twins (`eval.kernels: reference`)."""
    if kind == "reference":
        return "PyTorch reference twins (no Triton)"
    if kernels.INTERPRET:
        return "Triton interpreter" + ("" if torch.cuda.is_available() else " (no GPU)")
    return torch.cuda.get_device_name(device if device.type == "cuda" else None)


def summary_line(summary: dict[str, Any], out_dir: str) -> str:
    """The one line `python -m eval` prints at the end: τ, speedups, losslessness and where the report is."""
    fmt = lambda key, spec, unit="": "n/a" if summary[key] is None else format(summary[key], spec) + unit
    return (
        f"eval/accept_len {fmt('accept_len', '.3f')}  speedup vs plain {fmt('speedup_vs_plain', '.2f', 'x')}  "
        f"vs prompt lookup {fmt('speedup_vs_prompt_lookup', '.2f', 'x')}  lossless {summary['lossless_prompts']}"
        f"  -> {out_dir}/report.md"
    )


def run(recipe: Recipe) -> dict[str, Any] | None:
    """Evaluate; returns the summary on the main process (None on the others). `eval.output_dir` is locked
    meanwhile (`rundir.lock`): a second evaluation into it is refused with one line, on every one of its processes."""
    from accelerate import PartialState
    from accelerate.utils import gather_object, parse_flag_from_env

    # on CPU-only machines (or ACCELERATE_USE_CPU) processes talk gloo: `accelerate launch --multi_gpu` there
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
    key = f"{recipe.source}: eval.output_dir"
    with lock_for_all(output_dir(recipe), "evaluation", key, state.is_main_process, gather_object, error=EvalError):
        return _run(recipe, state)


def _run(recipe: Recipe, state) -> dict[str, Any] | None:
    from accelerate.utils import gather_object
    from tqdm import tqdm

    ev = recipe.eval
    if ev.prompts is None:
        raise EvalError(f"{recipe.source}: eval.prompts: is required (a JSONL file of prompts)")
    drafter_dir = drafter_directory(recipe.to_dict())
    out_dir = output_dir(recipe)
    config = read_config(drafter_dir)  # before any heavy work: the export exists and is a drafter
    exported = config["method"]
    if exported != recipe.drafter.method:
        method = recipe.drafter.method
        raise EvalError(
            f"{Path(drafter_dir) / 'config.json'}: method: the export holds a {exported} drafter, {recipe.source} has "
            f"drafter.method={method}; evaluate it with a {exported} recipe, or point eval.drafter at an export of a "
            f"{method} drafter"
        )
    if ev.drafter is None:  # the run's own export, picked implicitly: it must be of the run's newest checkpoint
        check_export_is_current(recipe, drafter_dir, config)
    check_output_dir(recipe, out_dir)
    target = load_placed_target(dataclasses.asdict(recipe.target), state)
    if target.tokenizer is None:
        raise EvalError(f"{recipe.source}: target.tokenizer: the target has no tokenizer to render prompts")
    keep_freed_memory(target.device)  # on a CPU: no page faults for every large temporary
    drafter = load_drafter(drafter_dir, target)
    target_desc = target.name
    method = METHODS[recipe.drafter.method]
    if method.adapts_target:  # Medusa-2: the LoRA-merged target verifies, and is the baseline too
        drafter = drafter.adapt_target(target)
        target_desc += f" + {recipe.drafter.method} LoRA (merged)"
    conversations = load_conversations(ev.context_source) if any(ev.context_lengths) else None
    prompts = load_prompts(ev.prompts, target.tokenizer, ev.max_prompts, ev.context_lengths, conversations)
    eos = stop_token_ids(target)
    settings = DecodeSettings.from_recipe(ev, eos)
    window = sliding_window(target.model)
    needed = max(len(p["input_ids"]) for p in prompts) + ev.max_new_tokens + ev.tree_total_tokens
    positions = target.config.to_dict().get("max_position_embeddings")  # not every architecture states one
    if positions is not None and needed > positions:
        key = "eval.context_lengths" if ev.context_lengths else "eval.prompts"
        raise EvalError(
            f"{recipe.source}: {key}: the longest prompt + eval.max_new_tokens + eval.tree_total_tokens is {needed} "
            f"tokens, beyond the target's max_position_embeddings ({positions})"
        )
    if window is not None and needed > window:  # refused before hours of decoding, not at the first long prompt
        raise EvalError(
            f"{recipe.source}: the target's sliding-window attention keeps {window} positions, and the longest prompt "
            f"+ eval.max_new_tokens + eval.tree_total_tokens is {needed}: evaluation runs such targets only within "
            "their window (shorter prompts, eval.max_prompts or eval.max_new_tokens)"
        )

    calibration: list[str] = []  # what the calibrated tree was measured on, for the report

    def calibrate(top_k: int) -> torch.Tensor:
        """Every process measures the same data, so every process builds the same tree."""
        samples, desc = calibration_samples(recipe, target.tokenizer, CALIBRATION_SAMPLES)
        calibration.append(desc)
        return resolve(method.calibration)(drafter, target, samples, top_k)

    draft_vocab = None
    if ev.draft_vocab:
        draft_vocab = draft_vocabulary(recipe, drafter_dir, ev.draft_vocab).to(target.device)
    if ev.head == "two_stage":
        draft_vocab, source = two_stage_projections(
            recipe, drafter_dir, drafter, target.config.vocab_size, lambda: fit_data(recipe, method, target, drafter)
        )
        print(f"eval: two-stage head, rank {ev.head_rank}, {ev.head_candidates} candidates, factors from {source}")
    reach = draft_window(ev, config)
    try:
        proposer, tree_desc = build_proposer(method, drafter, ev, calibrate, draft_vocab, reach)
    except EvalError:
        raise
    except ValueError as exc:  # e.g. a calibrated tree deeper than the heads
        raise EvalError(f"{recipe.source}: eval: {exc}") from None
    if ev.tree == "cost":  # verify / draft costs of this machine, target and drafter
        first = torch.tensor(prompts[0]["input_ids"])[None]
        proposer.costs = measure_costs(target.model, proposer, first, ev.tree_total_tokens, ev.batch_size)
        points = ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in proposer.costs.verify_points)
        print(
            f"eval: cost-aware tree: verify ms by size {{{points}}}, draft step {proposer.costs.draft_cost * 1e3:.1f}"
        )
    window = proposer.window  # what the drafter attends to, before prompt lookup wraps it
    lookup = None
    if ev.lookup_tokens:  # prompt-lookup candidates merged into the drafter's trees
        proposer = lookup = LookupProposer(proposer, ev.lookup_tokens, ev.lookup_ngram, ev.tree_total_tokens)
        tree_desc += f", + prompt lookup {ev.lookup_tokens} (n-gram <= {ev.lookup_ngram})"
    with state.split_between_processes(prompts) as local:
        batches = [local[i : i + ev.batch_size] for i in range(0, len(local), ev.batch_size)]
        if batches:  # warm-up (kernel compilation, allocator), not timed
            # Compiled Triton kernels get one variant per split count (it grows with the prefix), tree depth and
            # raggedness: on a GPU the longest batch decodes in full first, so that no compile lands in a timed run
            compiled = ev.kernels == "triton" and not kernels.INTERPRET
            longest = max(batches, key=lambda b: max(len(p["input_ids"]) for p in b))
            warm = settings if compiled else dataclasses.replace(settings, max_new_tokens=WARMUP_TOKENS)
            evaluate_batch(target, proposer, longest if compiled else batches[0], warm, ev)
            if lookup is not None:
                lookup.tried = lookup.accepted = 0  # the warm-up's lookup tokens are not counted
        bar = tqdm(total=len(local), desc=f"eval {recipe.drafter.method}", disable=not state.is_local_main_process)
        records = []
        for batch in batches:
            records += evaluate_batch(target, proposer, batch, settings, ev)
            bar.update(len(batch))
        bar.close()
    lookup_counts = [(lookup.tried, lookup.accepted)] if lookup is not None else []
    if state.num_processes > 1:
        records = gather_object(records)
        lookup_counts = gather_object(lookup_counts)
    if not state.is_main_process:
        return None
    meta = {
        "method": recipe.drafter.method,
        "tree": tree_desc,
        "target": target_desc,
        "drafter": drafter_dir,
        # what was evaluated: the export's own settings (recipe.yaml beside the report holds the recipe's section)
        "drafter_settings": config["drafter"],
        "prompts": ev.prompts,
        "max_new_tokens": ev.max_new_tokens,
        "temperature": ev.temperature,
        "top_p": ev.top_p,
        "acceptance": ev.acceptance,
        "kernels": ev.kernels,
        "kernels_backend": kernels_backend(ev.kernels, target.device),
        "device": str(target.device),
        "num_processes": state.num_processes,
        "batch_size": ev.batch_size,
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
        "tree_calibration": calibration[0] if calibration else None,
        "context_source": ev.context_source if any(ev.context_lengths) else None,
        "draft_window": window,
        "lookup": None,
    }
    if lookup is not None:
        tried, accepted = (sum(c[i] for c in lookup_counts) for i in (0, 1))
        meta["lookup"] = {
            "tokens": ev.lookup_tokens,
            "ngram": ev.lookup_ngram,
            "tried": tried,
            "accepted": accepted,
            "rate": accepted / tried if tried else None,
        }
    summary = summarize(records, meta)
    write_report(summary, out_dir)
    recipe.save(Path(out_dir) / "recipe.yaml")
    return summary
