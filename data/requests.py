"""Filters for user requests, shared by the prompt sources: synthesized ones (data.synthesize) and those read from
chat datasets (data.chatsets).

    english_problem(text)            -> "not English" or None
    Duplicates(near=0.7).why(text)   -> "duplicate" / "near duplicate" / None, remembering the text when it is new
    Contamination(questions).match(text) -> the benchmark question a request copies, or None

Words are runs of letters, digits and apostrophes, lower-cased. Duplicates are the same words (case and punctuation
ignored); near duplicates have an estimated Jaccard similarity of word 3-grams at or above the threshold (MinHash with
locality-sensitive hashing). Contamination is word n-gram overlap with benchmark questions, measured as the share of
a question's n-grams that a request holds, so a request that quotes a question whole inside a longer text is caught
as surely as a near copy of it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

COMMON_ENGLISH = frozenset(
    "the a an and or but if of to in on for with without about from as at by into over under between after before "
    "is are was were be been being am do does did have has had can could will would should shall may might must "
    "it its this that these those there here what how why when where which who whom whose "
    "i me my we us our you your he him his she her they them their not no all any some more most other such "
    "than then so very just also only please give make tell explain write".split()
)
ENGLISH_SHARE = 0.2
"""Share of words from COMMON_ENGLISH below which a request of five words or more is taken for another language
(English prose runs at 40-50%; German's "was" or French's "a" alone do not reach it)."""


def words(text: str) -> list[str]:
    return re.findall(r"[\w']+", text.lower())


def normalized(text: str) -> str:
    return " ".join(words(text))


def english_problem(text: str) -> str | None:
    """ "not English" when fewer than 95% of the letters are ASCII, or no word (under 20% of the words, for texts of
    five words or more) is a common English one; None otherwise."""
    ws = words(text)
    letters = [c for c in text if c.isalpha()]
    ascii_share = sum(c.isascii() for c in letters) / max(len(letters), 1)
    common = sum(w in COMMON_ENGLISH for w in ws)
    if ascii_share < 0.95 or not common or (len(ws) >= 5 and common / len(ws) < ENGLISH_SHARE):
        return "not English"
    return None


class NearDuplicates:
    """MinHash over word 3-grams (1-grams for requests under 3 words) with locality-sensitive hashing: `seen(text)`
    says whether an earlier added text has an estimated Jaccard similarity >= `threshold`, and adds it if not."""

    def __init__(self, threshold: float, num_perm: int = 64, bands: int = 16, seed: int = 0):
        self.threshold, self.bands, self.rows = threshold, bands, num_perm // bands
        rng = np.random.default_rng(seed)
        self.prime = (1 << 61) - 1
        self.a = rng.integers(1, self.prime, num_perm, dtype=np.uint64)
        self.b = rng.integers(0, self.prime, num_perm, dtype=np.uint64)
        self.buckets: dict[tuple[int, bytes], list[int]] = {}
        self.signatures: list[np.ndarray] = []

    def signature(self, text: str) -> np.ndarray:
        ws = words(text)
        n = 3 if len(ws) >= 3 else 1
        shingles = {" ".join(ws[i : i + n]) for i in range(len(ws) - n + 1)} or {""}
        hashes = np.array(
            [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big") >> 4 for s in shingles],
            dtype=np.uint64,
        )
        # (a·h + b) mod p over Python ints would be exact but slow; numpy's uint64 arithmetic wraps, which is still
        # a fixed hash family of the shingles (what MinHash needs), just not the textbook one
        return (hashes[None, :] * self.a[:, None] + self.b[:, None]).min(axis=1)  # (num_perm,)

    def seen(self, text: str, add: bool = True) -> bool:
        sig = self.signature(text)
        keys = [(band, sig[band * self.rows : (band + 1) * self.rows].tobytes()) for band in range(self.bands)]
        candidates = {i for key in keys for i in self.buckets.get(key, ())}
        if any(float((self.signatures[i] == sig).mean()) >= self.threshold for i in candidates):
            return True
        if add:
            index = len(self.signatures)
            self.signatures.append(sig)
            for key in keys:
                self.buckets.setdefault(key, []).append(index)
        return False


class Duplicates:
    """Exact and near duplicates among the texts handed to `why`, in order (the first of a group is kept).
    `near` = 1 turns near-duplicate detection off."""

    def __init__(self, near: float):
        self.exact: set[str] = set()
        self.near = NearDuplicates(near) if near < 1 else None

    def why(self, text: str, add: bool = True) -> str | None:
        """Why `text` repeats an earlier one ("duplicate", "near duplicate"), or None; with `add`, a text
        that is new is remembered."""
        key = normalized(text)
        if key in self.exact:
            return "duplicate"
        near = self.near is not None and self.near.seen(text, add=add)
        if add:
            self.exact.add(key)
        return "near duplicate" if near else None


@dataclass(frozen=True)
class Match:
    question: str
    """The benchmark question's id."""
    overlap: float
    """Share of the question's word n-grams found in the request."""


class Contamination:
    """Benchmark questions a training request must not copy: a request matches a question when it holds at least
    `threshold` of the question's word `n`-grams (questions shorter than n words: the question's words in order).

    `questions` maps an id to the question's text (each turn of a multi-turn question is its own entry)."""

    def __init__(self, questions: dict[str, str], n: int = 5, threshold: float = 0.5):
        self.n, self.threshold = n, threshold
        self.grams: dict[str, set[tuple[str, ...]]] = {}
        self.index: dict[tuple[str, ...], list[str]] = {}
        for qid, text in questions.items():
            grams = self._grams(words(text))
            self.grams[qid] = grams
            for g in grams:
                self.index.setdefault(g, []).append(qid)
        self.lengths = sorted({len(g) for g in self.index})
        """The n-gram lengths in use: n, and the lengths of questions shorter than n words."""

    def _grams(self, ws: list[str]) -> set[tuple[str, ...]]:
        n = min(self.n, len(ws))
        return {tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)} if n else set()

    def match(self, text: str) -> Match | None:
        ws = words(text)
        best: Match | None = None
        shared: dict[str, int] = {}
        for n in self.lengths:
            for g in {tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)}:
                for qid in self.index.get(g, ()):
                    shared[qid] = shared.get(qid, 0) + 1
        for qid, count in shared.items():
            overlap = count / len(self.grams[qid])
            if overlap >= self.threshold and (best is None or overlap > best.overlap):
                best = Match(qid, overlap)
        return best
