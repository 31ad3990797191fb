"""Helpers for equivalence checks that run anywhere (the test suite, `benchmarks/gpu_kernels.py` on a lent GPU).

- `ScriptedProposer`: a stub drafter that knows the plain greedy continuation, so a check can choose how often the
  target accepts (never, always, sometimes) without training anything; `RowProposer` is the base of such one-prompt
  stubs, `PerRow` runs one per prompt as a batch proposer:

    out = speculative_generate_batch(model, PerRow([ScriptedProposer(...) for prompt in prompts]), prompts, settings)

- `spread_layers`: place a target's decoder layers over several devices with the same accelerate hooks that
  `from_pretrained(device_map=...)` installs, so a one-machine check exercises a target spread over GPUs (and the
  CPU, where only one GPU is lent): KV caches on several devices, hidden states handed between them.
"""

from __future__ import annotations

import copy
import random
import weakref
from collections.abc import Sequence

import torch

from eval.proposal import DecodeState, Proposer
from eval.trees import Tree


class RowProposer:
    """Base of a drafter written for one prompt (stubs, scripted drafters): implement `propose_row(state) -> Tree`,
    and `reset_row()` / `commit_row(path)` if it keeps state. It is a batch of one; `PerRow` batches several."""

    feature_layers: list[int] = []

    def reset(self, batch_size: int) -> None:
        if batch_size != 1:
            raise ValueError(f"{type(self).__name__} drafts for one prompt; give one per prompt (PerRow)")
        self.reset_row()

    def propose(self, states: Sequence[DecodeState]) -> list[Tree]:
        return [self.propose_row(state) for state in states]

    def commit(self, paths: Sequence[list[int]]) -> None:
        for path in paths:
            self.commit_row(path)

    def keep_rows(self, rows: list[int]) -> None:
        pass

    def reset_row(self) -> None:
        pass

    def propose_row(self, state: DecodeState) -> Tree:
        raise NotImplementedError

    def commit_row(self, path: list[int]) -> None:
        pass


class PerRow:
    """A batch proposer whose row b is `proposers[b]`, run as a batch of one (each keeps its own state)."""

    def __init__(self, proposers: Sequence[Proposer]):
        if len({id(p) for p in proposers}) != len(proposers):
            raise ValueError("PerRow: proposers keep per-prompt state; pass a distinct proposer per prompt")
        layers = {tuple(p.feature_layers) for p in proposers}
        if len(layers) > 1:
            raise ValueError(f"PerRow: the proposers of one batch must read the same target layers, got {layers}")
        self.proposers = list(proposers)
        self.rows = list(proposers)
        self.feature_layers = list(proposers[0].feature_layers) if proposers else []

    def reset(self, batch_size: int) -> None:
        if batch_size != len(self.proposers):
            raise ValueError(f"one proposer per prompt: got {len(self.proposers)} proposers for {batch_size} prompts")
        self.rows = list(self.proposers)
        for proposer in self.rows:
            proposer.reset(1)

    def propose(self, states: Sequence[DecodeState]) -> list[Tree]:
        return [proposer.propose([state])[0] for proposer, state in zip(self.rows, states)]

    def commit(self, paths: Sequence[list[int]]) -> None:
        for proposer, path in zip(self.rows, paths):
            proposer.commit([path])

    def keep_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]


class ScriptedProposer(RowProposer):
    """Stub drafter that knows the plain greedy continuation `truth` of a prompt of `prompt_len` tokens.

    It drafts a fixed tree shape (`parents`); at every node it may make one child right (the true next token), the
    other children get distinct wrong tokens. `mode`: "never" (no child is right: every branch rejected), "always"
    (the first child is right: a chain is accepted in full), "sometimes" (a random child is right with probability
    0.6). `commits` records every accepted path.
    """

    feature_layers: list[int] = []

    def __init__(self, truth: list[int], prompt_len: int, parents: list[int], mode: str, vocab: int, seed: int = 0):
        if mode not in ("never", "always", "sometimes"):
            raise ValueError(f"ScriptedProposer: mode must be never, always or sometimes, got {mode!r}")
        self.truth, self.prompt_len, self.parents, self.mode, self.vocab = truth, prompt_len, parents, mode, vocab
        self.rng = random.Random(seed)
        self.commits: list[list[int]] = []

    def reset_row(self) -> None:
        self.commits.clear()

    def propose_row(self, state: DecodeState) -> Tree:
        shape = Tree.from_parents(self.parents)
        done = state.tokens.shape[1] - self.prompt_len  # generated so far; the root is truth[done - 1]
        tokens = [int(state.tokens[0, -1])] + [0] * (len(self.parents) - 1)
        right_node = {0: True}
        for node in range(len(self.parents)):
            kids = [c for c, p in enumerate(self.parents) if p == node]
            if not kids:
                continue
            idx = done - 1 + int(shape.depth[node]) + 1
            true = self.truth[idx] if idx < len(self.truth) and right_node.get(node) else None
            pick = {"never": None, "always": 0, "sometimes": self.rng.randrange(len(kids))}[self.mode]
            if self.mode == "sometimes" and self.rng.random() > 0.6:
                pick = None
            wrong = iter(t for t in range(self.vocab) if t != true)
            for j, child in enumerate(kids):
                is_right = true is not None and j == pick
                right_node[child] = is_right
                tokens[child] = true if is_right else next(wrong)
        return Tree.from_parents(self.parents, tokens=tokens)

    def commit_row(self, path: list[int]) -> None:
        self.commits.append(path)


def spread_layers(model: torch.nn.Module, devices: list[str | torch.device]) -> dict[str, torch.device]:
    """Move `model` (an HF causal LM) onto `devices` as a `device_map` would: the embeddings on the first, the
    decoder layers in contiguous equal runs, the final norm and lm_head on the last, each module behind an accelerate
    `AlignDevicesHook` that moves its inputs (not the KV cache) to its device. Returns the placement by module name.

    Unlike `accelerate.dispatch_model`, a "cpu" entry really runs on the CPU (dispatch_model would offload it and
    run it on the first GPU), so one GPU plus the CPU is a two-device target.
    """
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    devices = [torch.device(d) for d in devices]
    inner = model.model
    layers = inner.layers
    placement: dict[str, torch.device] = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    for i in range(len(layers)):
        placement[f"model.layers.{i}"] = devices[i * len(devices) // len(layers)]
    placement |= {"model.norm": devices[-1], "lm_head": devices[-1]}
    skip = getattr(model, "_skip_keys_device_placement", None)
    for name, device in placement.items():
        module = model.get_submodule(name)
        module.to(device)
        add_hook_to_module(module, AlignDevicesHook(execution_device=device, skip_keys=skip))
    return placement


# --------------------------------------------------------------------------------------------
# What "lossless" means for a target in bf16 or fp16

BF16_TIE_MARGIN = 0.5
"""Default `eval.tie_margin` for bf16 / fp16 targets, in logits of the float32 reference (see `near_tie`). On
SmolLM2-135M-Instruct the error of a bf16 forward on the margin between the float32 top-2 logits is 0.07 at the
median, 0.33 at the 99th and 0.51 at the 99.9th percentile (2469 positions of self-distilled answers)."""

_FLOAT32_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def float32_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of a (bf16 / fp16) target, made once per model on its first use, with transformers' own
    attention: the judge of near-ties, independent of the precision and the code paths being checked."""
    if model not in _FLOAT32_COPIES:
        reference = copy.deepcopy(model).float().eval()
        reference.set_attn_implementation("sdpa")
        _FLOAT32_COPIES[model] = reference
    return _FLOAT32_COPIES[model]


@torch.inference_mode()
def near_tie(model: torch.nn.Module, prefix: list[int], spec: int, plain: int, margin: float) -> dict:
    """Is the speculative decoder's token `spec` where plain decoding chose `plain` (after `prefix`) a rounding tie of
    the target rather than a mistake?

    In bf16 a forward over several tokens does not give bit-identical logits to one-token forwards, so speculative
    and plain greedy decoding can pick different tokens where the target's best tokens are within rounding of each
    other. Two independent judges, both running the target's own forward on `prefix` (no cache, none of the
    speculative loop's code):
    - `float32`: a float32 copy of the target; both tokens' logits are within `margin` of its best logit;
    - `own_forward`: the target in its own dtype, over the whole prefix at once, picks `spec` itself (the token is
      the target's greedy choice under another, equally valid, evaluation order).
    Either makes it a tie; anything else is a real mismatch. -> {"tie", "judge", "tokens": [spec, plain], "margin":
    the larger float32 distance to the best logit, "reference_top": the float32 argmax}."""
    ids = torch.tensor([prefix], device=next(model.parameters()).device)
    own_top = int(model(input_ids=ids).logits[0, -1].argmax())
    reference = float32_reference(model)
    logits = reference(input_ids=ids.to(next(reference.parameters()).device)).logits[0, -1].float()  # (V,)
    best = logits.max()
    gap = float(max(best - logits[spec], best - logits[plain]))
    judge = "float32" if gap <= margin else "own_forward" if own_top == spec else None
    return {"tie": judge is not None, "judge": judge, "tokens": [spec, plain], "margin": round(gap, 5),
            "reference_top": int(logits.argmax())}  # fmt: skip


def near_boundary(
    model: torch.nn.Module, prefix: list[int], spec: int, plain: int, coin: float, settings, tolerance: float
) -> dict:
    """Sampled decoding's near-tie: both decoders drew with the same coin (`eval.decode.PositionCoins`), so different
    tokens mean the coin fell where their distributions' CDFs differ. A float32 copy of the target, on `prefix`, gives
    the reference distribution; the draw is a rounding tie when the coin lies within `tolerance` (probability mass)
    of both tokens' CDF intervals, i.e. on the boundary between them. -> {"tie", "judge", "tokens", "margin": the
    larger distance of the coin from either interval, "reference_token": the reference's own draw}."""
    from eval.reference import sample_from, target_probs

    reference = float32_reference(model)
    ids = torch.tensor([prefix], device=next(reference.parameters()).device)
    logits = reference(input_ids=ids).logits[0, -1].float()
    probs = target_probs(logits[None], settings.temperature, settings.top_p)[0]  # (V,)
    cdf = probs.cumsum(0)
    point = coin * float(cdf[-1])

    def distance(token: int) -> float:
        lo, hi = (float(cdf[token - 1]) if token else 0.0), float(cdf[token])
        return max(lo - point, point - hi, 0.0)

    gap = max(distance(spec), distance(plain))
    drawn = int(sample_from(probs[None], torch.tensor([coin], device=probs.device))[0])
    return {"tie": gap <= tolerance, "judge": "coin_boundary" if gap <= tolerance else None, "tokens": [spec, plain],
            "margin": gap, "reference_token": drawn}  # fmt: skip


BOUNDARY_TOLERANCE = 1e-3
"""Probability mass within which a sampled draw sits on the boundary between two tokens for a bf16 / fp16 target
(their probabilities move by about that between evaluation orders); 1e-6 for float32."""


def tie_margin(ev, target) -> float:
    """`eval.tie_margin`, or by default 0 for a float32 target (exact) and BF16_TIE_MARGIN for bf16 / fp16."""
    if ev.tie_margin is not None:
        return ev.tie_margin
    return 0.0 if target.dtype == torch.float32 else BF16_TIE_MARGIN
