"""Build the pocket prompt sets from the corpus splits (inputs for self-distillation).

    python recipes/pocket/prompts.py --corpus artifacts/pocket-corpus --out recipes/pocket/prompts

Writes `train.jsonl` (3000 prompts from TRAIN-split files, or `--train-size`) and `heldout.jsonl` (100 prompts
from HELD-OUT-split files), records `{"id": "<path>:<line>", "prompt": str}`. A prompt is the text of
whole lines starting at a block start (a file's first line, or a non-blank line after a blank
one) and is 32-96 tokens long (pocket tokenizer, target length drawn per block from a hash).
Every file's beginning comes first; the remaining prompts are block starts ordered by a hash of
their id, so the sets are deterministic and do not depend on the order files are listed.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

MIN_TOKENS, MAX_TOKENS = 32, 96
SIZES = {"train": 3000, "heldout": 100}


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def block_prompt(lines: list[str], start: int, target: int, n_tokens) -> str | None:
    """Whole lines from `start` until `target` tokens are reached without exceeding MAX_TOKENS."""
    text = ""
    for line in lines[start:]:
        if n_tokens(text + line) > MAX_TOKENS:
            break
        text += line
        if n_tokens(text) >= target:
            return text
    return text if n_tokens(text) >= MIN_TOKENS else None


def split_prompts(corpus: Path, split: str, size: int, n_tokens) -> list[dict[str, str]]:
    firsts, others = [], []
    with open(corpus / f"{split}.jsonl", encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    for doc in docs:
        lines = doc["text"].splitlines(keepends=True)
        starts = [0] + [i for i in range(1, len(lines)) if lines[i].strip() and not lines[i - 1].strip()]
        for start in starts:
            rid = f"{doc['path']}:{start + 1}"
            (firsts if start == 0 else others).append(rid)
    # Only build the prompts we need: file beginnings first, then hash-ordered block starts.
    texts = {doc["path"]: doc["text"].splitlines(keepends=True) for doc in docs}
    records = []
    for rid in sorted(firsts, key=stable_hash) + sorted(others, key=stable_hash):
        path, line = rid.rsplit(":", 1)
        target = MIN_TOKENS + stable_hash("len" + rid) % (MAX_TOKENS - MIN_TOKENS + 1)
        prompt = block_prompt(texts[path], int(line) - 1, target, n_tokens)
        if prompt is not None and prompt.strip():
            records.append({"id": rid, "prompt": prompt})
        if len(records) == size:
            break
    if len(records) < size:
        raise ValueError(
            f"{corpus / f'{split}.jsonl'}: only {len(records)} prompts of {MIN_TOKENS}-{MAX_TOKENS} tokens, "
            f"{size} asked for"
        )
    return sorted(records, key=lambda r: stable_hash(r["id"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, required=True)
    parser.add_argument("--tokenizer", default="recipes/pocket/target")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--train-size",
        type=int,
        default=SIZES["train"],
        help="training prompts; a larger set holds every prompt of a smaller one (data-scaling runs)",
    )
    parser.add_argument("--splits", nargs="+", choices=list(SIZES), default=list(SIZES), help="which sets to write")
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)

    def n_tokens(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    args.out.mkdir(parents=True, exist_ok=True)
    sizes = {**SIZES, "train": args.train_size}
    for split in args.splits:
        try:
            records = split_prompts(args.corpus, split, sizes[split], n_tokens)
        except ValueError as e:
            sys.exit(f"prompts: {e}")
        with open(args.out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        print(f"{split}: {len(records)} prompts -> {args.out / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
