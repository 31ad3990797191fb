"""A self-distillation output as a resumable run: what binds it (the target's identity, the settings), which records
are done, the per-process part files and their merge in prompt order. `data.selfdistill` drives it."""

from __future__ import annotations

import glob
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from data.files import durable_replace
from data.generation import SelfDistillError

IDENTITY_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
)


WEIGHT_SAMPLE_BYTES = 1 << 20
"""Bytes of a weight file hashed at its start, middle and end: hashing GBs whole is too slow, and a retrained or
fine-tuned model of the same shapes (the same file sizes) changes every one of them."""


def weights_fingerprint(path: Path) -> str:
    """sha256 over a weight file's size and three samples of its bytes (start, middle, end)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        for start in (0, max(0, size // 2 - WEIGHT_SAMPLE_BYTES // 2), max(0, size - WEIGHT_SAMPLE_BYTES)):
            f.seek(start)
            digest.update(f.read(WEIGHT_SAMPLE_BYTES))
    return f"bytes:{size},sampled-sha256:{digest.hexdigest()}"


def check_new_tokens(target: str, max_new_tokens: int, error: type[Exception]) -> None:
    """Refuse --max-new-tokens that the target cannot hold: at least its max_position_embeddings (from config.json,
    read without loading the model), which generation would run past until memory gives out."""
    from schema.sections import TargetConfig

    positions = TargetConfig(path=target).size("max_position_embeddings")
    if positions is not None and max_new_tokens >= positions:
        raise error(
            f"--max-new-tokens {max_new_tokens}: {target} holds {positions} positions (max_position_embeddings in "
            "its config.json), prompt included; ask for fewer"
        )


def target_identity(target: str) -> dict[str, Any]:
    """Path, hashes of the config and tokenizer files, and of samples of the weight files (`weights_fingerprint`)."""
    path = Path(target)
    if not path.is_dir():
        return {"name": target}
    files = {}
    for f in sorted(path.iterdir()):
        if f.name in IDENTITY_FILES:
            files[f.name] = "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
        elif f.suffix in (".safetensors", ".bin"):
            files[f.name] = weights_fingerprint(f)
    return {"path": str(path.resolve()), "files": files}


def run_difference(previous: dict[str, Any] | None, meta: dict[str, Any]) -> str | None:
    """What differs between OUT's recorded settings and target and this run's (None: the same run). A weight file
    recorded by its size alone (before samples of its bytes were hashed) matches on its size, so a run started then
    can still be finished."""
    if previous is None:
        return "no readable record of its settings"
    before_settings, now_settings = previous.get("settings") or {}, meta["settings"]
    for key in [*now_settings, *(k for k in before_settings if k not in now_settings)]:  # the settings' order
        old, new = before_settings.get(key), now_settings.get(key)
        if old != new:
            if key == "prompts":
                return "other prompts (the prompt file's content differs)"
            return f"--{key.replace('_', '-')} {old!r} there, {new!r} now"
    before, now = previous.get("target") or {}, meta["target"]
    if "files" not in before or "files" not in now:
        return None if before == now else "another target"
    changed = sorted(k for k in before.keys() | now.keys() if k != "files" and before.get(k) != now.get(k))
    if changed:
        return f"another target (its {changed[0]} differs)"
    if before["files"].keys() != now["files"].keys():
        return "another target (other weight files)"
    for name, old in before["files"].items():
        new = now["files"][name]
        by_size_only = isinstance(old, str) and old.startswith("bytes:") and "," not in old
        if old != new and not (by_size_only and new.split(",")[0] == old):
            return f"another target (its {name} differs)"
    return None


def read_done(out: Path) -> set[str]:
    """Ids already in OUT. A last line without its newline (an interrupted write) is cut off the file."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    done: set[str] = set()
    for line_no, line in enumerate(complete.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rid = str(json.loads(line)["id"])
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise SelfDistillError(f"{out}:{line_no}: malformed record (delete the file to start over)") from None
        if rid in done:
            raise SelfDistillError(f"{out}:{line_no}: duplicate id {rid!r}")
        done.add(rid)
    if len(complete) < len(data):
        print(f"{out}: dropping a truncated last line ({len(data) - len(complete)} bytes)", file=sys.stderr)
        with open(out, "r+b") as f:
            f.truncate(len(complete))
    return done


def part_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.name}.part{rank}")


def part_files(out: Path) -> list[Path]:
    """The part files of OUT (an OUT name with glob characters, e.g. `sd[v2].jsonl`, is matched literally)."""
    return sorted(out.parent.glob(f"{glob.escape(out.name)}.part*")) if out.parent.is_dir() else []


def merge_parts(out: Path, prompts: list[tuple[str, dict[str, Any]]]) -> int:
    """Fold every process's part file into OUT, records in the order of `prompts` (the whole prompt file, so that a
    run with a smaller --limit keeps the order, hence the sample ids, of one with a larger), through a temporary
    file, an fsync and a rename; then delete the parts. Returns the number of records in OUT."""
    by_id: dict[str, str] = {}
    sources = [out, *part_files(out)]
    for path in sources:
        if path.exists():
            read_done(path)  # validates, drops a torn last line
            # records end at "\n" only: a JSON string may hold U+2028 and the like, which str.splitlines splits at
            for raw in path.read_bytes().split(b"\n"):
                if raw.strip():
                    line = raw.decode("utf-8")
                    by_id.setdefault(str(json.loads(line)["id"]), line)
    order = [rid for rid, _ in prompts if rid in by_id] + sorted(set(by_id) - {rid for rid, _ in prompts})
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(by_id[rid] + "\n" for rid in order), encoding="utf-8")
    durable_replace(tmp, out)  # on disk before the parts it replaces are deleted
    for path in sources[1:]:
        path.unlink()
    return len(order)
