"""Export and import: a trained drafter to the files serving engines load, and other projects' drafters back in.

    python -m export RUN_DIR [--format native|medusa|eagle|sglang|vllm|speculators] [--out DIR]
    python -m export.imports SRC --format eagle|speculators|medusa --target TARGET --out DIR

Files: `write.py` (a run or a native export -> each format; the command above), `eagle3_layouts.py` (the EAGLE-3
layouts of vLLM / speculators and SGLang, written and read back), `gates.py` (the load gates: one table, a
re-implementation of each consumer's loading code that must give the trained drafter's draft logits) and
`gate_parts.py` (what every gate builds its consumer from), `imports.py` (another project's export -> a native one).
Below it: models (the drafters, native files: `models.io`), data (the held-out split, the draft vocabulary's
counts) and train's checkpoint files; nothing here is imported by train or eval.
"""
