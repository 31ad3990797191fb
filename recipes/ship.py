"""`recipes/run.py SET --ship`: a trained export copied into the set's `shipped` directory with PROVENANCE.json
(where the target and the data came from, the training run, every file's sha256), never over files it did not
write."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from models.io import EXPORT_MARKER, SHIP_PROVENANCE, foreign_files
from recipes.steps import ROOT, banner, records_in, sha256, shown, trained_steps

PIPELINE = "pipeline.yaml"


def distill_provenance(distill: dict[str, Any]) -> dict[str, Any] | None:
    """A self-distillation job's recorded settings and record count (None before it ran)."""
    meta = ROOT / (distill["out"] + ".meta.json")
    if not meta.is_file():
        return None
    return (
        {"out": distill["out"]}
        | json.loads(meta.read_text())["settings"]
        | {"records": records_in(ROOT / distill["out"])}
    )


def synthesis_provenance(synth: dict[str, Any] | None) -> dict[str, Any] | None:
    """The synthesized prompts' settings, filters and counts (None without that step)."""
    meta = ROOT / (synth["out"] + ".meta.json") if synth else None
    if meta is None or not meta.is_file():
        return None
    recorded = json.loads(meta.read_text())
    return {"out": synth["out"]} | {
        k: recorded.get(k) for k in ("settings", "filters", "candidates", "kept", "removed")
    }


def ship(spec: dict[str, Any], method: str, recipe: dict[str, Any], directory: Path) -> None:
    """Copy a trained export (native format, draft vocabulary, training metrics) into the set's `shipped` directory
    with PROVENANCE.json: where the target and the data came from, the training run, and every file's sha256."""
    if method not in (spec.get("shipped") or {}):
        sys.exit(f"run: {directory / PIPELINE}: shipped: has no directory for {method!r}")
    run_dir = ROOT / recipe["train"]["output_dir"]
    dest = ROOT / spec["shipped"][method]
    banner(f"ship {method}: {run_dir / 'export'} -> {spec['shipped'][method]}")
    problem = ship_dir_problem(dest)
    if problem is not None:  # checked before training too; again here, just before anything is replaced
        sys.exit(f"run: {directory / PIPELINE}: shipped.{method}: {problem}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{dest.name}.ship-", dir=dest.parent))  # a name nobody else uses
    umask = os.umask(0)
    os.umask(umask)
    staged.chmod(0o777 & ~umask)  # as any new directory (mkdtemp makes it 0700)
    try:
        write_ship(staged, spec, method, recipe, directory, run_dir)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if dest.exists():  # an earlier ship (or export, or an empty directory): moved aside until the new one is in place
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.replaced-", dir=dest.parent))
        dest.rename(old / dest.name)
        staged.rename(dest)
        shutil.rmtree(old)
    else:
        staged.rename(dest)
    files = json.loads((dest / PROVENANCE).read_text())["files_sha256"]
    print(f"  {len(files)} files, {sum((dest / f).stat().st_size for f in files) / 1e6:.1f} MB", flush=True)


PROVENANCE = SHIP_PROVENANCE


def ship_dir_problem(dest: Path) -> str | None:
    """Why `--ship` must not replace `dest` (None: it may): only a directory that is recognisably this project's
    is replaced (a previous ship, holding its PROVENANCE.json and only the files that lists; an export, holding
    models.io's marker; or an empty one). A symbolic link, a file, or a directory holding anything else (a
    user's files, a model) is refused, naming it: replacing it would delete them."""
    if dest.is_symlink():
        return f"{dest} is a symbolic link; name the directory itself"
    if not dest.exists():
        return None
    if not dest.is_dir():
        return f"{dest} is a file, not a shipped drafter's directory; choose another path"
    entries = sorted(p.name for p in dest.iterdir())
    if not entries:
        return None
    if EXPORT_MARKER in entries:
        foreign = foreign_files(dest)
        if not foreign:
            return None
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        return (
            f"{dest} holds {foreign[0]}{more}, which no export wrote, beside an export, and --ship replaces the "
            "directory whole; move them away and ship again"
        )
    if PROVENANCE not in entries:
        return (
            f"{dest} is not a shipped drafter (no {PROVENANCE}) nor an export (no {EXPORT_MARKER}), and --ship "
            "replaces the directory whole: it holds files it did not write; choose another path, or empty it yourself"
        )
    try:
        listed = json.loads((dest / PROVENANCE).read_text(encoding="utf-8"))["files_sha256"]
        listed = set(listed) if isinstance(listed, dict) else None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        listed = None
    if listed is None:
        return f"{dest / PROVENANCE}: not a ship's provenance (no files_sha256); move it away or empty {dest}"
    foreign = [name for name in entries if name != PROVENANCE and (name not in listed or not (dest / name).is_file())]
    if foreign:
        return (
            f"{dest} holds {foreign[0]}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}, which no ship "
            f"wrote (not in its {PROVENANCE}), and --ship replaces the directory whole; move it away and ship again"
        )
    return None


def write_ship(
    dest: Path, spec: dict[str, Any], method: str, recipe: dict[str, Any], directory: Path, run_dir: Path
) -> None:
    """The shipped files of `method` into the empty directory `dest`: the export, metrics, target config and
    PROVENANCE.json."""
    for f in (run_dir / "export").iterdir():
        if f.is_file() and f.name != EXPORT_MARKER:  # the shipped copy is the recipe set's, not an export to replace
            shutil.copyfile(f, dest / f.name)
    shutil.copyfile(run_dir / "metrics.jsonl", dest / "metrics.jsonl")
    # The target's architecture, so that the drafter can be checked (and loaded) without the target's weights.
    shutil.copyfile(ROOT / spec["target"] / "config.json", dest / "target_config.json")
    target_provenance = ROOT / spec["target"] / "provenance.json"
    files = {f.name: sha256(f) for f in sorted(dest.iterdir()) if f.is_file() and f.name != PROVENANCE}
    provenance = {
        "method": method,
        "recipe": spec["recipes"][method],
        "pipeline": shown(directory / PIPELINE),
        "command": f"python recipes/run.py {shown(directory)} --methods {method} --ship",
        "target": json.loads(target_provenance.read_text()) if target_provenance.is_file() else spec["target"],
        "synthesize": synthesis_provenance(spec.get("synthesize")),
        "selfdistill": [distill_provenance(distill) for distill in spec.get("selfdistill") or ()],
        "training": {"steps": trained_steps(run_dir), "batch_size": recipe["train"]["batch_size"]},
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "files_sha256": files,
    }
    (dest / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
