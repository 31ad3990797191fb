"""The frozen target and what every drafter builds on: the target's parts a drafter borrows (`target`, `common`),
its lm_head and low-rank heads (`lm_head`), the losses of drafters with their own head (`losses`), the native export's
files (`io`), memory accounting (`memory`), typed recipe sections (`typed`) and the packaged models (`fetch`). The
drafters themselves are in `methods/<name>/`.
"""
