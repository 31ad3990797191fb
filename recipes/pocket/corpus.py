"""Build the pocket target's pretraining corpus from openly licensed offline text.

    python recipes/pocket/corpus.py --out artifacts/pocket-corpus [--allow-missing-docs]

Sources (both PSF-licensed, present on the machine without network):
  * the Python standard library sources (`sysconfig.get_paths()["stdlib"]`, minus site-packages);
  * the Python documentation sources from Debian `python3.11-doc`
    (`apt-get install -y python3.11-doc` -> /usr/share/doc/python3.11/html/_sources/**/*.rst.txt).

Each file is one document. Files are split BY FILE into train / valid / heldout by a hash of
their source-relative path, so the split is deterministic and independent of the file list.
Writes `{split}.jsonl` (one `{"path", "text"}` record per document, sorted by path) and
`manifest.json` (counts, bytes, skipped non-UTF-8 files).
"""

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
SPLITS = {"train": 96, "valid": 2, "heldout": 2}  # percent of files


def split_of(rel_path: str) -> str:
    """Deterministic split from the first 8 bytes of sha256(rel_path)."""
    bucket = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big") % 100
    upper = 0
    for name, percent in SPLITS.items():
        upper += percent
        if bucket < upper:
            return name
    raise AssertionError("split percentages must sum to 100")


def source_files(allow_missing_docs: bool) -> list[tuple[str, Path]]:
    """(relative name, path) for every corpus file; names are prefixed `stdlib/` or `docs/`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [
        (f"stdlib/{p.relative_to(stdlib).as_posix()}", p)
        for p in stdlib.rglob("*.py")
        if "site-packages" not in p.relative_to(stdlib).parts and p.is_file()
    ]
    docs = sorted(DOCS_DIR.rglob("*.rst.txt")) if DOCS_DIR.is_dir() else []
    if not docs:
        message = f"Python docs sources not found under {DOCS_DIR} (apt-get install -y python3.11-doc)"
        if not allow_missing_docs:
            sys.exit(f"error: {message}; pass --allow-missing-docs to build from the stdlib only")
        print(f"WARNING: {message}; continuing with the stdlib only", file=sys.stderr)
    files += [(f"docs/{p.relative_to(DOCS_DIR).as_posix()}", p) for p in docs]
    return sorted(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--allow-missing-docs", action="store_true")
    args = parser.parse_args()

    docs: dict[str, list[dict[str, str]]] = {name: [] for name in SPLITS}
    skipped: list[str] = []
    for rel, path in source_files(args.allow_missing_docs):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if text.strip():
            docs[split_of(rel)].append({"path": rel, "text": text})

    args.out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"splits": {}, "skipped_non_utf8": skipped}
    for name, records in docs.items():
        with open(args.out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        n_bytes = sum(len(r["text"].encode()) for r in records)
        manifest["splits"][name] = {"documents": len(records), "bytes": n_bytes}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for name, stats in manifest["splits"].items():
        print(f"{name:8s} {stats['documents']:6d} docs {stats['bytes'] / 1e6:8.2f} MB")
    print(f"skipped {len(skipped)} non-UTF-8 files -> {args.out}")


if __name__ == "__main__":
    main()
