"""Evaluation: speculative decoding with tree verification against plain decoding (`python -m eval RECIPE`).

    from eval.run import run               # the whole evaluation of a recipe -> summary (report files written)
    from eval.decode import speculative_generate, DecodeSettings
    from eval.baselines import plain_generate

Files: `trees.py` (tree shapes; the named Medusa trees are data in `methods/named_trees.py`), `kernels/` (Triton)
and `reference.py` (its PyTorch twins), `proposers.py` (drafters as the loop uses them), `heads.py` (the two-stage
draft head), `decode.py` (the speculative loop), `baselines.py` (plain decoding and prompt lookup), `run.py` (prompts,
drafter, batches, report), `report.py`, `checks.py` (losslessness judges and stub drafters), `__main__.py` (the
command line).
"""

REPORT_FILES = ("report.json", "report.md", "report.png", "recipe.yaml")
"""What an evaluation writes to its output directory (recipe.yaml: the settings it ran with)."""


class EvalError(ValueError):
    """Bad eval input (prompts file, drafter, tree); the message names the file / key."""
