"""Conversations (JSONL or a `datasets` source) -> token samples with assistant-only loss masks.

    python -m data.prepare RECIPE [key=value ...] [--show N]

Reads `data.train_files` in the given order (or `data.hf_dataset`), renders every record with the
target tokenizer (chat template for ShareGPT / OpenAI records, `bos + prompt + completion + eos`
for plain ones), truncates to `data.max_len` keeping the beginning, takes the tail of each loop out of the loss
(`data.max_repeat_run`, `cap_repeat_runs`), and reports what it counted.
A sample's id is its record's global index in reading order, so ids do not move when other
records are skipped. `--show N` prints N samples with the loss-masked text in [[...]].
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

from data.chat import (
    ChatTemplateError,
    DataError,
    normalize_messages,
    render_with_assistant_mask,
    render_with_turn_ids,
)
from data.repeats import repeating

if TYPE_CHECKING:  # schema.recipe pulls in every drafter; data preparation needs none of them
    from schema.sections import DataConfig

__all__ = [
    "ChatTemplateError",
    "DataError",
    "PreparedData",
    "TokenSample",
    "TokenizedRecord",
    "detect_format",
    "prepare_dataset",
    "template_fingerprint",
    "tokenize_record",
]


class TokenSample(TypedDict):
    id: int
    input_ids: list[int]
    loss_mask: list[int]


class TokenizedRecord(NamedTuple):
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class PreparedData:
    samples: list[TokenSample]
    num_records: int
    """Records read (malformed ones included)."""
    num_skipped: int
    """Malformed records skipped under `skip_malformed`."""
    num_truncated: int
    """Samples cut to `max_len` that kept some loss tokens."""
    num_dropped: int
    """Samples whose loss mask was empty after truncation."""
    num_repeats_left_out: int | None = None
    """Loss tokens `data.max_repeat_run` took out of the loss (None: no cap)."""

    def stats(self) -> dict[str, int]:
        return {
            "records": self.num_records,
            "samples": len(self.samples),
            "tokens": sum(len(s["input_ids"]) for s in self.samples),
            "loss_tokens": sum(sum(s["loss_mask"]) for s in self.samples),
            "skipped_malformed": self.num_skipped,
            "truncated": self.num_truncated,
            "dropped_after_truncation": self.num_dropped,
            "repeats_left_out": self.num_repeats_left_out,  # None without a cap, as in manifests written before it
        }


def detect_format(record: dict[str, Any]) -> str:
    """`sharegpt`, `openai` or `plain` from the keys present (None values count as absent)."""
    if record.get("conversations") is not None:
        return "sharegpt"
    if record.get("messages") is not None:
        return "openai"
    if record.get("prompt") is not None and record.get("completion") is not None:
        return "plain"
    raise DataError(
        f"cannot detect format: expected `conversations`, `messages` or `prompt` + `completion`, "
        f"got keys {sorted(record)}"
    )


def _generation(record: dict[str, Any]) -> dict[str, Any]:
    """A record's `generation` (what self-distillation wrote about it), {} when absent."""
    generation = record.get("generation") or {}
    if not isinstance(generation, dict):
        raise DataError(f"`generation` must be an object (what self-distillation writes), got {generation!r:.60}")
    return generation


def cut_turns(record: dict[str, Any]) -> frozenset[int]:
    """Numbers of the generated turns (completions, assistant turns) a length limit cut off, from the
    `generation.finish_reason` list self-distillation writes (one reason per generated turn, in order)."""
    reasons = _generation(record).get("finish_reason") or []
    if not isinstance(reasons, list) or any(reason not in ("stop", "length") for reason in reasons):
        what = '`generation.finish_reason` must be a list of "stop" / "length", one per generated turn'
        raise DataError(f"{what}, got {reasons!r:.60}")
    return frozenset(i for i, reason in enumerate(reasons) if reason == "length")


def _token_ids(value: Any, vocab_size: int, key: str = "completion_ids") -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in value):
        raise DataError(f"`{key}` must be a list of token ids below the vocabulary size {vocab_size}")
    return value


def _tokenize_plain(record: dict[str, Any], tokenizer: Any) -> TokenizedRecord:
    for key in ("prompt", "completion"):
        if not isinstance(record.get(key), str):
            raise DataError(f"plain record needs a string `{key}`")
    # Prompt and completion are tokenized apart, as at inference (prompt encoded, completion generated).
    prompt = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    if record.get("completion_ids") is not None:  # self-distilled: the target's own tokens, its stop token included
        if record["completion_ids"] == []:
            raise DataError("`completion_ids` is empty (a generation holds at least its stop token)")
        _same_vocabulary(record, tokenizer)
        completion, eos = _token_ids(record["completion_ids"], len(tokenizer)), []
    else:
        # An empty answer (written by hand, or cut to nothing) would teach the drafter to end every such text at once.
        if not record["completion"].strip():
            raise DataError("empty completion (nothing to learn but the end of the text)")
        completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        # A completion cut off by a length limit did not end: no EOS for the drafter to learn there.
        eos = [] if tokenizer.eos_token_id is None or 0 in cut_turns(record) else [tokenizer.eos_token_id]
    ids = bos + prompt + completion + eos
    mask = [0] * (len(bos) + len(prompt)) + [1] * (len(completion) + len(eos))
    if not any(mask):
        raise DataError("plain record has an empty completion and no eos token to learn")
    return TokenizedRecord(ids, mask)


def _tokenize_full(record: Any, tokenizer: Any, fmt: str) -> TokenizedRecord:
    if not isinstance(record, dict):
        raise DataError(f"a record must be a JSON object, got {type(record).__name__}")
    found = detect_format(record)
    if fmt != "auto" and found != fmt:
        raise DataError(f"data.format is {fmt} but the record looks like {found}")
    if found == "plain":
        return _tokenize_plain(record, tokenizer)
    if found == "sharegpt" and record.get("messages") is not None:
        raise DataError("record has both `conversations` and `messages`")
    messages, cut = normalize_messages(record), cut_turns(record)
    if record.get("assistant_ids") is None:
        # An empty answer (written by hand, or cut to nothing) would teach the drafter to end every such turn at once.
        empty = next((j for j, m in enumerate(messages) if m["role"] == "assistant" and not m["content"].strip()), None)
        if empty is not None:
            raise DataError(f"turn {empty}: empty assistant turn (nothing to learn but its end marker)")
        return TokenizedRecord(*render_with_assistant_mask(messages, tokenizer, cut))
    # Self-distilled: the target's own tokens for every assistant turn, not its text re-encoded.
    _same_vocabulary(record, tokenizer)
    turns = record["assistant_ids"]
    if not isinstance(turns, list):
        raise DataError("`assistant_ids` must be a list with one list of token ids per assistant turn")
    turn_ids = [_token_ids(t, len(tokenizer), f"assistant_ids[{k}]") for k, t in enumerate(turns)]
    empty = next((k for k, ids in enumerate(turn_ids) if not ids), None)
    if empty is not None:
        raise DataError(f"`assistant_ids[{empty}]` is empty (a generated turn holds at least its stop token)")
    return TokenizedRecord(*render_with_turn_ids(messages, tokenizer, turn_ids, cut))


def tokenize_record(record: dict[str, Any], tokenizer: Any, fmt: str, max_len: int) -> TokenizedRecord:
    """One record -> (input_ids, loss_mask), cut to `max_len` (the mask may then be all zero).

    `fmt` is auto | sharegpt | openai | plain. Raises DataError (no location; callers add it).
    """
    ids, mask = _tokenize_full(record, tokenizer, fmt)
    return TokenizedRecord(ids[:max_len], mask[:max_len])


def read_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    """Yield (location, record); a line that is not UTF-8 JSON yields a DataError in place of the record."""
    if not Path(path).is_file():
        raise DataError(f"{path}: no such file")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                byte = raw[exc.start]
                yield where, DataError(f"{where}: not UTF-8 text (byte {byte:#04x} at column {exc.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, DataError(f"{where}: bad JSON: {exc.msg} (column {exc.colno})")


def _read_hf(name: str, split: str) -> Iterator[tuple[str, Any]]:
    import datasets

    path = Path(name)
    if path.is_file():  # a single local data file: pick the builder from its extension
        builder = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}.get(path.suffix)
        if builder is None:
            raise DataError(f"{name}: unsupported data file type {path.suffix!r}")
    try:
        if path.is_file():
            ds = datasets.load_dataset(builder, data_files=str(path), split=split)
        else:
            ds = datasets.load_dataset(name, split=split)
    except (OSError, ValueError, ConnectionError) as exc:  # no such dataset or split (FileNotFoundError is an OSError)
        why = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise DataError(f"data.hf_dataset: {name}[{split}] cannot be loaded ({why})") from None
    for i, record in enumerate(ds):
        yield f"{name}[{split}] record {i}", record


def cap_repeat_runs(ids: list[int], mask: list[int], keep: int) -> tuple[list[int], list[int], int]:
    """Keep the first `keep` tokens of every run of consecutive repeating loss tokens (`data.repeats.repeating` over
    the loss tokens: the answers' own text, not the prompt's) in the loss, take the rest out (a greedy answer that
    falls into a loop repeats to its end: the first turn of the loop teaches the drafter to follow it, the later ones
    teach nothing new). Where the sample ends inside such a tail (only positions without loss after it), it is cut
    there. -> (ids, mask, loss tokens taken out)."""
    capped, run, left_out, tail = list(mask), 0, 0, None
    for t, repeats in enumerate(repeating(ids, mask)):
        if not mask[t]:
            run = 0  # a run is consecutive loss tokens: a prompt or template token ends it
            continue
        run = run + 1 if repeats else 0
        if run > keep:
            capped[t], left_out = 0, left_out + 1
            tail = t if tail is None else tail
        else:
            tail = None
    if tail is not None and not any(capped[tail:]):
        return ids[:tail], capped[:tail], left_out
    return ids, capped, left_out


def _records(cfg: DataConfig) -> Iterator[tuple[str, Any]]:
    if cfg.train_files:
        for path in cfg.train_files:
            yield from read_jsonl(path)
    else:
        yield from _read_hf(cfg.hf_dataset, cfg.hf_split)


def prepare_dataset(cfg: DataConfig, tokenizer: Any) -> PreparedData:
    """Read, render, mask and truncate every record of `cfg`; see the module docstring."""
    capped = cfg.max_repeat_run is not None
    out = PreparedData(
        samples=[],
        num_records=0,
        num_skipped=0,
        num_truncated=0,
        num_dropped=0,
        num_repeats_left_out=0 if capped else None,
    )
    loss_tokens = 0
    for index, (where, record) in enumerate(_records(cfg)):
        if cfg.max_samples is not None and len(out.samples) >= cfg.max_samples:
            break
        if cfg.max_loss_tokens is not None and loss_tokens >= cfg.max_loss_tokens:
            break
        out.num_records += 1
        try:
            if isinstance(record, DataError):
                raise record
            ids, mask = _tokenize_full(record, tokenizer, cfg.format)
        except DataError as exc:
            if cfg.skip_malformed:
                out.num_skipped += 1
                continue
            msg = str(exc) if str(exc).startswith(where) else f"{where}: {exc}"
            raise DataError(msg + " (set data.skip_malformed=true to skip such records)") from None
        except ChatTemplateError as exc:
            raise ChatTemplateError(f"{where}: {exc}") from None
        if len(ids) > cfg.max_len:
            ids, mask = ids[: cfg.max_len], mask[: cfg.max_len]
            if not any(mask):
                out.num_dropped += 1
                continue
            out.num_truncated += 1
        if capped:
            ids, mask, left_out = cap_repeat_runs(ids, mask, cfg.max_repeat_run)
            out.num_repeats_left_out += left_out
        out.samples.append(TokenSample(id=index, input_ids=ids, loss_mask=mask))
        loss_tokens += sum(mask)
    if not out.samples:  # nothing to extract or train on: say why rather than write an empty dataset
        source = (
            f"data.train_files: {', '.join(cfg.train_files)}"
            if cfg.train_files
            else f"data.hf_dataset: {cfg.hf_dataset}"
        )
        raise DataError(
            f"{source}: no usable samples ({out.num_records} records, {out.num_skipped} malformed skipped, "
            f"{out.num_dropped} without loss tokens after truncation to data.max_len={cfg.max_len})"
        )
    return out


def data_sources(cfg: DataConfig) -> dict[str, Any]:
    """Where a dataset's samples come from, as recorded in feature manifests: training refuses features extracted
    from other sources (changed `data.train_files` without re-extracting). Files are compared by resolved path."""
    return {
        "train_files": [str(Path(f).resolve()) for f in cfg.train_files],
        "hf_dataset": cfg.hf_dataset,
        "hf_split": cfg.hf_split if cfg.hf_dataset else None,
        "format": cfg.format,
        "max_samples": cfg.max_samples,
        "max_loss_tokens": cfg.max_loss_tokens,
        "max_repeat_run": cfg.max_repeat_run,
        "skip_malformed": cfg.skip_malformed,
    }


def template_fingerprint(tokenizer: Any) -> str:
    """Short sha256 of what decides token ids and masks: chat template, vocab size, special tokens."""
    special = dict(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))
    blob = json.dumps(
        {"chat_template": tokenizer.chat_template, "vocab_size": len(tokenizer), "special_tokens": special},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def vocab_fingerprint(tokenizer: Any) -> str:
    """Short sha256 of the token -> id map (what token ids mean), computed once per tokenizer object: self-distilled
    records carry it (`generation.vocab`), so that their ids are never read with another vocabulary of the same
    size."""
    cached = _VOCAB_FINGERPRINTS.get(tokenizer)
    if cached is None:
        blob = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
        cached = _VOCAB_FINGERPRINTS[tokenizer] = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return cached


_VOCAB_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""tokenizer -> its fingerprint, for as long as the tokenizer lives."""


def _same_vocabulary(record: dict[str, Any], tokenizer: Any) -> None:
    """Token ids in a record (`completion_ids`, `assistant_ids`) mean tokens of the vocabulary that wrote them."""
    made = _generation(record).get("vocab")
    if made is not None and made != vocab_fingerprint(tokenizer):
        raise DataError(
            f"`generation.vocab`: its token ids were written with another vocabulary ({made}, this target's "
            f"{vocab_fingerprint(tokenizer)}): self-distil again with this target, or drop the ids to train on the text"
        )


def format_masked(sample: TokenSample, tokenizer: Any) -> str:
    """Decode a sample with every run of loss-masked tokens wrapped in [[...]]."""
    parts, run, run_masked = [], [], None
    for tok, m in zip([*sample["input_ids"], None], [*sample["loss_mask"], None]):
        if m != run_masked and run:
            text = tokenizer.decode(run, skip_special_tokens=False)
            parts.append(f"[[{text}]]" if run_masked else text)
            run = []
        run.append(tok)
        run_masked = m
    return "".join(parts)


def main(argv: list[str] | None = None) -> None:
    from schema.recipe import RecipeError, load_recipe

    parser = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument("--show", type=int, default=0, metavar="N", help="print N samples, loss-masked text in [[...]]")
    args = parser.parse_args(argv)
    try:
        inputs = ("target.path", "target.tokenizer", "data.train_files")
        recipe = load_recipe(args.recipe, args.overrides, inputs=inputs)
        from transformers import AutoTokenizer  # only once the recipe is valid: a bad one fails at once

        name = recipe.target.tokenizer or recipe.target.path
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=recipe.target.trust_remote_code)
        except (OSError, ValueError) as exc:
            key = "target.tokenizer" if recipe.target.tokenizer else "target.path"
            why = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise RecipeError(f"{recipe.source}: {key}: no tokenizer could be loaded from {name} ({why})") from None
        data = prepare_dataset(recipe.data, tokenizer)
    except (RecipeError, DataError, ChatTemplateError) as exc:
        sys.exit(f"error: {exc}")
    print(json.dumps({**data.stats(), "template": template_fingerprint(tokenizer)}, indent=1))
    for sample in data.samples[: args.show]:
        print(f"\n--- sample {sample['id']} ({len(sample['input_ids'])} tokens, {sum(sample['loss_mask'])} masked)")
        print(format_masked(sample, tokenizer))


if __name__ == "__main__":
    main()
