"""The held-out split of a training run, recorded in its run directory: evaluation reads the samples training held out
instead of re-creating the split from the recipe (which would go wrong once the data, `data.heldout_fraction` or
`train.seed` change after training), and export counts draft-vocabulary tokens without them. Here, below train and
eval, so that both read it without one importing the other.

    write_heldout(recipe.train.output_dir, heldout_sample_ids)   # training, once the split is made
    read_heldout(recipe.train.output_dir)                        # -> [sample id, ...], or None for a run without one

The file is `<output_dir>/heldout.json`: {"sample_ids": [...]} in split order (data ids as `data.shards.split_by_id`
takes them: feature-shard `sample_ids`, or the prepared samples' `id`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from data.files import write_json_atomic

HELDOUT_FILE = "heldout.json"


class HeldoutError(ValueError):
    """A `heldout.json` that is not one `write_heldout` wrote; the message names the file."""


def write_heldout(output_dir: str | Path, sample_ids: Sequence[int | str]) -> Path:
    """Record the held-out samples' ids in `<output_dir>/heldout.json` (the directory is created); returns the file.
    Written whole or not at all (`data.files.write_json_atomic`); a resumed run rewrites the same content."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = [i if isinstance(i, str) else int(i) for i in sample_ids]  # numpy / torch ints -> JSON numbers
    write_json_atomic(out / HELDOUT_FILE, {"sample_ids": ids})
    return out / HELDOUT_FILE


def read_heldout(output_dir: str | Path) -> list[int | str] | None:
    """The held-out sample ids a run recorded, or None when `output_dir` holds no `heldout.json` (a run from before
    splits were recorded, or no run at all)."""
    path = Path(output_dir) / HELDOUT_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))["sample_ids"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise HeldoutError(f"{path}: not a held-out split written by training ({type(exc).__name__}: {exc})") from None
    if not isinstance(ids, list) or not all(isinstance(i, (int, str)) and not isinstance(i, bool) for i in ids):
        raise HeldoutError(f"{path}: sample_ids must be a list of sample ids (integers or strings)")
    return ids
