"""Training: a drafter from a recipe, with exact resumption (`accelerate launch -m train RECIPE`, `python -m train`).

    from train.loop import train           # the whole run of a recipe -> newest checkpoint
    from train.export import export        # a checkpoint -> native / engine formats

Files: `config.py` (the recipe schema) and `schema.py` (YAML -> typed dataclasses, overrides), `loop.py` (accelerator,
target, loaders, the step and the loop), `resume.py` (which checkpoint to continue from, saving and restoring a run),
`checkpoint.py` (checkpoint files), `state.py` (name-keyed model and optimizer state under any backend), `optim.py`
(AdamW groups and schedule), `export.py`, `__main__.py` (the command line). The held-out split a run records is
`data/heldout.py`: evaluation and export read it too.
"""


class TrainingError(RuntimeError):
    """A run that cannot start or continue; the message says why and what to do."""
