"""Training: a drafter from a recipe, with exact resumption (`accelerate launch -m train RECIPE`, `python -m train`).

    from train.loop import train           # the whole run of a recipe -> newest checkpoint

Files: `loop.py` (target, loaders, the step and the loop), `launch.py` (the accelerator and the tracker), `resume.py`
(which checkpoint to continue from, saving and restoring a run), `checkpoint.py` (checkpoint files), `state.py`
(name-keyed model and optimizer state under any backend), `optim.py` (AdamW groups and schedule), `curves.py`,
`__main__.py` (the command line). Elsewhere: the recipe schema (`schema/`), exporting a checkpoint (`export/`), a
run's checkpoints as other stages find them (`rundir/`), the held-out split a run records (`data/heldout.py`).
"""


class TrainingError(RuntimeError):
    """A run that cannot start or continue; the message says why and what to do."""
