"""Run directories as every stage finds them: one writer per output (`lock.py`) and a run's checkpoints, the newest
and the state each records (`checkpoints.py`). Standard library only: it imports nothing of ours, and every package
may import it.
"""
