"""Export and import: a trained drafter to the files serving engines load, and other projects' drafters back in.

    python -m export RUN_DIR [--format native|medusa|eagle|sglang|vllm|speculators] [--out DIR]
    python -m export.imports SRC --format eagle|eagle3|speculators|medusa --target TARGET --out DIR

Files: `write.py` (a run or a native export -> the native files, or the format's writer its method's entry names;
the command above), `gates.py` (running the method's load gate for a format: a re-implementation of the consumer's
loading code that must give the trained drafter's draft logits) and `gate_parts.py` (what every gate builds its
consumer from), `imports.py` (another project's checkpoint -> a native export, through the importer a method's entry
names). The writers, gates and importers themselves live in each method's folder (`methods/<name>/layouts.py`,
`gates.py`, `imports.py`). Below it: models (native files: `models.io`), data (the held-out split, the draft
vocabulary's counts) and train's checkpoint files; nothing here is imported by train or eval.
"""
