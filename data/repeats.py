"""Where a token sequence repeats itself: greedy decoding of a small target often ends in a loop that runs to the
length limit. Used to take loops out of the training loss (`data.max_repeat_run`, `data.prepare`) and to split an
evaluation's τ into rounds inside loops and elsewhere (`eval.decode.rounds_in_loop`)."""

from __future__ import annotations

REPEAT_NGRAM = 8
"""A position repeats when the REPEAT_NGRAM tokens ending at it already ended at an earlier position."""


def repeating(ids: list[int], counted: list[int] | None = None) -> list[bool]:
    """Per position: whether the REPEAT_NGRAM tokens ending there already ended at an earlier counted position
    (`counted`: 0 / 1 per position, e.g. a loss mask, so that only answer text counts; default every position).
    Positions that are not counted are never repeats."""
    seen: set[tuple[int, ...]] = set()
    flags = []
    for t in range(len(ids)):
        if counted is not None and not counted[t]:
            flags.append(False)
            continue
        gram = tuple(ids[t - REPEAT_NGRAM + 1 : t + 1]) if t >= REPEAT_NGRAM - 1 else None
        flags.append(gram is not None and gram in seen)
        if gram is not None:
            seen.add(gram)
    return flags
