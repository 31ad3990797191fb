"""Prompts without a dataset: the target writes its own user requests (the Magpie method).

    python -m data.synthesize --target DIR --out prompts.jsonl --count 4000 [--kinds kinds.yaml] \
        [--max-new-tokens 96 --temperature 1 --top-p 1 --seed 0 --batch-size 32]
    accelerate launch --num_processes N -m data.synthesize ...     (same arguments, candidates split by batch)

An instruction-tuned model given only its chat template's user prefix (`<|im_start|>user\\n` after the system turn,
say) writes what a user would ask, and ends the turn itself (Xu et al., 2024, "Magpie: Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing"). The prefix is found by rendering a conversation whose user turn is
a sentinel through the tokenizer's chat template, so every template family works. Generation stops at the target's
EOS tokens and at the token that closes a user turn in the template.

Steering (`--kinds FILE.yaml`): a list of kinds, each with a `name` and optionally a `system` message (the template
must accept a system turn) and an `opener`, words the request is made to start with (they are part of the request):

    kinds:
      - {name: general}
      - {name: writing, opener: "Write"}
      - {name: roleplay, opener: "Imagine you are"}

Candidate i is of kind i mod (number of kinds) and is sampled from a generator seeded by (--seed, i), so a candidate
does not depend on the batch it ran in, the number of processes or a resume. Candidates are kept in
OUT.candidates.jsonl (appended and fsynced a batch at a time: a killed run resumes where it stopped; a larger
--count extends it), then filtered into OUT (written whole under a temporary name and renamed):

  * unfinished: generation hit --max-new-tokens before the turn ended;
  * empty, too short (< --min-words words), too long (> --max-words);
  * template text: special tokens or role markers of the template leaked into the request;
  * not English (`--language en`; `any` keeps every language): few ASCII letters or no common English word;
  * answer or refusal: starts as an assistant reply would ("Sure", "I'm sorry", "As an AI", ...);
  * repetitive: a word 3-gram repeated three times or more, or few distinct words;
  * duplicate (the same words, ignoring case and punctuation), near duplicate (estimated Jaccard similarity of word
    3-grams >= --near-duplicate to an earlier kept request, by MinHash with locality-sensitive hashing).

OUT holds chat prompt records, the format `data.selfdistill` and `python -m eval` read:
`{"id", "kind", "messages": [{"role": "user", "content"}], "source": {method, target, candidate, seed, ...}}`.
OUT.meta.json records the settings, the target's identity and how many candidates each filter removed. Filters run
again on every call (they are cheap); resuming onto candidates made with other generation settings, kinds or another
target is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

from data.files import durable_replace
from data.generation import Generator, SelfDistillError
from data.requests import Duplicates, english_problem, words
from data.selfdistill import first_line, record_seed
from data.selfdistill_parts import (
    check_new_tokens,
    merge_parts,
    part_files,
    part_path,
    read_done,
    run_difference,
    target_identity,
)
from rundir.lock import lock_for_all
from schema.parse import safe_load, yaml_problem

SENTINEL = "\x00specdraft-user-request\x00"
MAX_COUNT = 10_000_000
"""--count's bound: the candidate list is planned whole before generating."""


class SynthesizeError(ValueError):
    pass


@dataclass(frozen=True)
class Kind:
    name: str
    system: str | None = None
    opener: str | None = None


@dataclass(frozen=True)
class SynthesisSettings:
    """Everything that determines the candidates; a resumed run must match it exactly."""

    kinds: str
    """sha256 of the kinds (names, system messages, openers)."""
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    dtype: str
    batch_size: int


@dataclass(frozen=True)
class FilterSettings:
    min_words: int = 4
    max_words: int = 200
    language: str = "en"
    near_duplicate: float = 0.7


# ------------------------------------------------------------------------------------------------
# The template's user prefix


def read_kinds(path: Path | None) -> list[Kind]:
    """Kinds from a YAML file (errors name the file and entry); one plain kind without a file."""
    if path is None:
        return [Kind("general")]
    if path.is_dir():
        raise SynthesizeError(f"{path}: is a directory; --kinds names a YAML file")
    if not path.is_file():
        raise SynthesizeError(f"{path}: no such kinds file")
    try:
        spec = safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise SynthesizeError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise SynthesizeError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
    entries = spec.get("kinds") if isinstance(spec, dict) else None
    if not isinstance(entries, list) or not entries:
        raise SynthesizeError(f"{path}: needs `kinds:`, a non-empty list of {{name, system?, opener?}}")
    kinds, names = [], set()
    for j, entry in enumerate(entries):
        where = f"{path}: kinds[{j}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise SynthesizeError(f"{where}: needs a `name` string")
        unknown = set(entry) - {"name", "system", "opener"}
        if unknown:
            raise SynthesizeError(f"{where}: unknown keys {sorted(unknown)} (known: name, system, opener)")
        for key in ("system", "opener"):
            if entry.get(key) is not None and (not isinstance(entry[key], str) or not entry[key].strip()):
                raise SynthesizeError(f"{where}: `{key}` must be a non-empty string")
        if entry["name"] in names:
            raise SynthesizeError(f"{where}: duplicate name {entry['name']!r}")
        names.add(entry["name"])
        kinds.append(Kind(entry["name"], entry.get("system"), entry.get("opener")))
    return kinds


def user_prefix(tokenizer, kind: Kind) -> tuple[list[int], str]:
    """(token ids of the conversation up to where the user's words start, the text that closes a user turn): the
    chat template rendered around a sentinel user turn, cut at the sentinel; the opener follows the prefix."""
    messages = ([{"role": "system", "content": kind.system}] if kind.system else []) + [
        {"role": "user", "content": SENTINEL}
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    except Exception as exc:  # jinja2's raise_exception(), e.g. a template without a system role
        raise SynthesizeError(f"kind {kind.name!r}: the chat template rejects its turns ({first_line(exc)})") from None
    if text.count(SENTINEL) != 1:
        raise SynthesizeError(f"kind {kind.name!r}: the chat template does not render the user's words verbatim")
    before, after = text.split(SENTINEL)
    ids = tokenizer(before, add_special_tokens=False)["input_ids"]
    if kind.opener:
        # the opener joins the prefix as text, so it is tokenized the way the target would have continued
        ids = tokenizer(before + kind.opener, add_special_tokens=False)["input_ids"]
    return ids, after


def turn_end_ids(tokenizer, after: str) -> list[int]:
    """The token that closes a user turn (`<|im_end|>`, `<|eot_id|>`, ...) when the template's text after the user's
    words starts with a special token; none otherwise (a plain newline must not end a request)."""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return ids[:1] if ids and ids[0] in special else []


# ------------------------------------------------------------------------------------------------
# Filters


ANSWER_STARTS = (
    "sure",
    "certainly",
    "of course",
    "absolutely",
    "here is",
    "here's",
    "i'm sorry",
    "i am sorry",
    "sorry,",
    "as an ai",
    "as a language model",
    "i cannot",
    "i can't",
    "i'm unable",
    "i am unable",
    "i'm not able",
)


def template_markers(tokenizer) -> list[str]:
    """Text that never appears in a real request but does when the model runs on into the template: the
    tokenizer's special tokens and the role headers of the pocket and ChatML-style templates."""
    special = [t for t in tokenizer.all_special_tokens if t]
    added = [t.content for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values() if t.special]
    return sorted({*special, *added, "<|assistant|>", "<|user|>", "<|system|>"} - {""})


def rejection(text: str, finish: str, markers: list[str], cfg: FilterSettings) -> str | None:
    """Why a candidate is not a usable request (None: it is), before de-duplication."""
    if finish != "stop":
        return "unfinished"
    stripped = text.strip()
    if not stripped:
        return "empty"
    if any(m in stripped for m in markers):
        return "template text"
    ws = words(stripped)
    if len(ws) < cfg.min_words:
        return "too short"
    if len(ws) > cfg.max_words:
        return "too long"
    if cfg.language == "en" and english_problem(stripped):
        return "not English"
    if stripped.lower().startswith(ANSWER_STARTS):
        return "answer or refusal"
    grams = [tuple(ws[i : i + 3]) for i in range(len(ws) - 2)]
    if grams and max(grams.count(g) for g in set(grams)) >= 3:
        return "repetitive"
    if len(ws) >= 20 and len(set(ws)) / len(ws) < 0.35:
        return "repetitive"
    return None


def select(candidates: list[dict[str, Any]], markers: list[str], cfg: FilterSettings) -> tuple[list, dict[str, int]]:
    """(kept candidates in candidate order, number removed per reason)."""
    removed: dict[str, int] = {}
    duplicates = Duplicates(cfg.near_duplicate)
    kept = []
    for cand in candidates:
        why = rejection(cand["text"], cand["finish_reason"], markers, cfg) or duplicates.why(cand["text"])
        if why is None:
            kept.append(cand)
        else:
            removed[why] = removed.get(why, 0) + 1
    return kept, removed


# ------------------------------------------------------------------------------------------------
# Entry


def candidate_id(i: int) -> str:
    return f"candidate-{i:07d}"


def kinds_sha256(kinds: list[Kind]) -> str:
    return hashlib.sha256(json.dumps([asdict(k) for k in kinds], sort_keys=True).encode()).hexdigest()


def write_prompts(out: Path, kept: list[dict[str, Any]], kinds: list[Kind], settings: SynthesisSettings, name: str):
    lines = []
    for cand in kept:
        kind = kinds[cand["candidate"] % len(kinds)]
        record = {
            "id": f"synth-{cand['candidate']:07d}",
            "kind": kind.name,
            "messages": [{"role": "user", "content": cand["text"].strip()}],
            "source": {
                "method": "magpie",
                "target": name,
                "candidate": cand["candidate"],
                "seed": cand["seed"],
                "temperature": settings.temperature,
                "top_p": settings.top_p,
                "system": kind.system,
                "opener": kind.opener,
            },
        }
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(lines), encoding="utf-8")
    durable_replace(tmp, out)


def read_candidates(path: Path) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in path.read_bytes().split(b"\n") if raw.strip()] if path.exists() else []


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="HF causal LM directory with a chat template")
    parser.add_argument("--out", type=Path, required=True, help="the prompt records (JSONL)")
    parser.add_argument("--count", type=int, required=True, help="candidates to generate (a larger one extends)")
    parser.add_argument("--kinds", type=Path, default=None, help="YAML list of kinds to steer the requests")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="default: this process's accelerator, else cpu")
    parser.add_argument("--min-words", type=int, default=FilterSettings.min_words)
    parser.add_argument("--max-words", type=int, default=FilterSettings.max_words)
    parser.add_argument("--language", default=FilterSettings.language, choices=["en", "any"])
    parser.add_argument(
        "--near-duplicate", type=float, default=FilterSettings.near_duplicate, help="1 keeps near duplicates"
    )
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)
    if args.count < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        parser.error("need --count >= 1, --batch-size >= 1, --max-new-tokens >= 1")
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        parser.error("need --temperature > 0 (greedy decoding would write one request per kind) and 0 < --top-p <= 1")
    if not 0 < args.near_duplicate <= 1 or args.min_words < 0 or args.max_words < max(args.min_words, 1):
        parser.error("need 0 < --near-duplicate <= 1 and 0 <= --min-words <= --max-words")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.count > MAX_COUNT:
        raise SynthesizeError(f"--count {args.count}: at most {MAX_COUNT:,} candidates a run (each is a generation)")
    if args.out.is_dir():
        raise SynthesizeError(f"{args.out}: is a directory; --out names the JSONL file to write")
    if not (Path(args.target) / "config.json").is_file():
        raise SynthesizeError(f"{args.target}: not a Hugging Face model directory (no config.json)")
    check_new_tokens(args.target, args.max_new_tokens, SynthesizeError)
    kinds = read_kinds(args.kinds)

    from accelerate import PartialState
    from accelerate.utils import gather_object, parse_flag_from_env

    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available())
    # one writer per output: a second synthesis into the same --out stops on every process with one line
    with lock_for_all(args.out, "synthesis", "--out", state.is_main_process, gather_object, True, SynthesizeError):
        synthesize(args, kinds, state)


def synthesize(args: argparse.Namespace, kinds: list[Kind], state) -> None:
    """Generate the missing candidates (this process's batches), then, on the main process, filter them into --out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.target, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise SynthesizeError(f"{args.target}: no tokenizer could be loaded ({first_line(exc)})") from None
    if not tokenizer.chat_template:
        raise SynthesizeError(f"{args.target}: the tokenizer has no chat template to take a user prefix from")
    prefixes = [user_prefix(tokenizer, kind) for kind in kinds]

    settings = SynthesisSettings(
        kinds=kinds_sha256(kinds),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        dtype=args.dtype,
        batch_size=args.batch_size,
    )
    meta = {"settings": asdict(settings), "target": target_identity(args.target)}
    candidates_path = args.out.with_name(args.out.name + ".candidates.jsonl")
    meta_path = args.out.with_name(args.out.name + ".meta.json")
    order = [(candidate_id(i), {}) for i in range(args.count)]
    if state.is_main_process:
        if candidates_path.exists() or part_files(candidates_path):
            try:
                previous = json.loads(meta_path.read_text()) if meta_path.exists() else None
            except (json.JSONDecodeError, UnicodeDecodeError):
                previous = None
            why = run_difference(previous, meta)
            if why is not None:
                if why.startswith("--kinds "):
                    why = "other kinds (names, system messages or openers differ)"
                raise SynthesizeError(
                    f"{candidates_path} holds candidates made with {why} (see {meta_path}); refusing to resume: "
                    "delete it (and its .part files) to start over, or write to another --out"
                )
            merge_parts(candidates_path, order)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    state.wait_for_everyone()
    done = read_done(candidates_path)

    batches = [list(range(k, min(k + args.batch_size, args.count))) for k in range(0, args.count, args.batch_size)]
    mine = [b for k, b in enumerate(batches) if k % state.num_processes == state.process_index]
    todo = [b for b in mine if any(candidate_id(i) not in done for i in b)]
    if todo:
        dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                args.target, dtype=dtype, trust_remote_code=args.trust_remote_code
            )
        except (OSError, ValueError) as exc:
            raise SynthesizeError(f"{args.target}: the model cannot be loaded ({first_line(exc)})") from None
        model.to(args.device or state.device).eval()
        extra_stops = sorted({t for _, after in prefixes for t in turn_end_ids(tokenizer, after)})
        generate = Generator(model, tokenizer, settings, extra_stop_ids=extra_stops)
        desc = f"synthesize [{state.process_index}/{state.num_processes}]" if state.num_processes > 1 else "synthesize"
        part = part_path(candidates_path, state.process_index)
        with open(part, "a", encoding="utf-8") as f, tqdm(total=sum(map(len, todo)), desc=desc, unit="cand") as bar:
            for batch in todo:
                seeds = [record_seed(args.seed, candidate_id(i), 0) for i in batch]
                inputs = [prefixes[i % len(kinds)][0] for i in batch]
                for i, seed, (text, reason, ids) in zip(batch, seeds, generate(inputs, seeds)):
                    if candidate_id(i) not in done:
                        opener = kinds[i % len(kinds)].opener or ""
                        record = {"id": candidate_id(i), "candidate": i, "seed": seed, "finish_reason": reason}
                        f.write(json.dumps(record | {"text": opener + text, "ids": ids}, ensure_ascii=False) + "\n")
                f.flush()  # a whole batch at a time: a crash loses at most the batch being written
                os.fsync(f.fileno())
                bar.update(len(batch))
    state.wait_for_everyone()
    if not state.is_main_process:
        return
    merge_parts(candidates_path, order)
    every = read_candidates(candidates_path)
    candidates = [c for c in every if c["candidate"] < args.count]
    cfg = FilterSettings(args.min_words, args.max_words, args.language, args.near_duplicate)
    kept, removed = select(candidates, template_markers(tokenizer), cfg)
    write_prompts(args.out, kept, kinds, settings, Path(args.target).name)
    meta |= {"filters": asdict(cfg), "candidates": len(candidates), "kept": len(kept), "removed": removed}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    reasons = ", ".join(f"{n} {why}" for why, n in sorted(removed.items(), key=lambda kv: -kv[1])) or "none"
    print(f"{args.out}: {len(kept)} prompts kept of {len(candidates)} candidates (removed: {reasons})")


if __name__ == "__main__":
    try:
        main()
    except (SynthesizeError, SelfDistillError) as exc:
        sys.exit(f"error: {exc}")
