"""The real consumers on PyPI of the `eagle` and `medusa` exports load them and must give our draft logits.

    make check-consumers            # builds .venv-consumers and runs the cases below
    .venv/bin/python benchmarks/consumers_check.py prepare OUT [--rope-theta THETA | --rope-dynamic]
    .venv-consumers/bin/python benchmarks/consumers_check.py consume OUT

The consumers: SafeAILab's `eagle-llm` 1.2.1 (the EAGLE release on PyPI) and FasterDecoding's `medusa-llm` 0.1
(the Medusa release on PyPI). Both are built on transformers 4 (their Llama code reads `rope_scaling["type"]`,
which transformers 5 configs no longer carry), so they run in their own virtual environment with transformers
4.36 and without their pinned extras (web UI, fschat), which loading and drafting do not use.

`prepare` (project environment) builds a tiny random Llama target (`--rope-theta` sets its RoPE base), saves it
as an HF model directory OUT/target (the consumers load their base model from there), trains two drafters on it
for a few steps from the tiny recipes (EAGLE-2 without FC-Norm / post-norm, since the EAGLE-1/2 layout holds
neither; Medusa-1 with 5 heads of 1 layer, what FasterDecoding's loader builds), exports them with
`--format eagle --include-target-weights` (the 1.2.1 loader is strict and needs the embedding in the file) and
`--format medusa`, and writes OUT/inputs.safetensors: one random token sequence, the target's last hidden states
on it, and our drafters' logits (`eagle_reference`: the EAGLE drafter on the target's features and the next
tokens; `medusa_reference`: the Medusa heads on the last hidden states).

`consume` (the consumers' environment) imports nothing from this project. It loads the exports through the
consumers' own entry points, `EaModel.from_pretrained(base_model_path=OUT/target, ea_model_path=...)` (which reads
`config.json` and `pytorch_model.bin` and loads the drafter strictly) and `MedusaModel.from_pretrained(...)`
(which reads `medusa_lm_head.pt` and the base model named by `base_model_name_or_path`), then runs their drafter
(`ea_layer` on the same features and next tokens, logits through their base model's lm_head), their
`MedusaModel.forward` on the token sequence (their base model computes the hidden states) and their loaded heads on
our hidden states, and compares. Ends with `consumers/max_abs_logit_diff: <x> (goal <= 0.0001)`.

Both releases predate `rope_theta`: their Llama code builds RoPE on base 10000 whatever the config says (SafeAILab's
current code on GitHub reads it). `--rope-theta 500000` shows what that costs: the heads still match on our hidden
states, but the EAGLE drafter and Medusa's base model compute other logits; `consume --expect-rope-base-10000`
passes when exactly that shows (`make check-consumers` runs both cases). `--rope-dynamic` gives the target dynamic
(NTK) RoPE scaling with `max_position_embeddings` 8, so the base grows over the 24-token sequence: SafeAILab's
drafter and Medusa's transformers-4 base model must build it as the project does (a third case of the target).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from logit_diffs import LogitDiffs

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1e-4
SEQ_LEN = 24
MEDUSA_HEADS = 5  # what FasterDecoding's loader builds


DYNAMIC_MAX_POSITIONS = 8  # below SEQ_LEN: the dynamic NTK base grows within the compared sequence


def tiny_target(
    out: Path, recipe: str, rope_theta: float | None = None, dynamic: bool = False, num_layers: int | None = None
) -> Path:
    """OUT/target: the tiny recipe's random Llama (`num_layers` deep instead of the recipe's when given) saved as an
    HF directory a transformers-4 consumer reads."""
    from models.io import add_legacy_rope
    from models.target import load_target
    from schema.recipe import load_recipe

    target_dir = out / "target"
    if not (target_dir / "config.json").is_file():
        spec = load_recipe(str(ROOT / recipe)).target
        config = dict(spec.random_init)
        if num_layers is not None:
            config["num_hidden_layers"] = num_layers
        if rope_theta is not None:
            config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
        if dynamic:
            config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
            config["max_position_embeddings"] = DYNAMIC_MAX_POSITIONS
        target = load_target(random_init=config, tokenizer=spec.tokenizer, dtype="float32", seed=spec.seed)
        target.model.save_pretrained(target_dir)
        add_legacy_rope(target_dir)  # as `models.fetch` writes a real target: `rope_theta` for transformers 4
        target.tokenizer.save_pretrained(target_dir)
        # transformers 5 names the fast tokenizer `TokenizersBackend`; transformers 4 reads the same tokenizer.json
        # as `PreTrainedTokenizerFast` (the consumers load it; drafting does not use it)
        tok_config = target_dir / "tokenizer_config.json"
        tok = json.loads(tok_config.read_text())
        tok_config.write_text(json.dumps({**tok, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    return target_dir


def train_and_export(out: Path, target_dir: Path, recipe: str, extra: list[str], fmt: str, **export_args):
    """Train `recipe` for a few steps on the saved target under OUT, export it as `fmt` to OUT/export; returns the
    run's (target, drafter in float32, eval mode)."""
    from data.extract import main as extract_main
    from export.write import export, load_run
    from schema.recipe import load_recipe
    from train.loop import train

    run, features = out / "run", out / "features"
    overrides = [
        f"target.path={target_dir}",
        "target.random_init=null",
        "target.tokenizer=null",
        "logging.tracker=none",
        "train.max_steps=6",
        "train.eval_every=0",
        f"data.features_dir={features}",
        *extra,
    ]
    if not (features / "manifest.json").is_file():
        extract_main([str(ROOT / recipe), *overrides])
    if not (run / "recipe.yaml").is_file():
        train(load_recipe(str(ROOT / recipe), [*overrides, f"train.output_dir={run}"]))
    export(run, out / "export", fmt=fmt, **export_args)
    _, target, drafter = load_run(run)
    return target, drafter.float().eval()


def drafter_batch(drafter, ids, hidden, layers: list[int]) -> dict:
    """One unpadded sequence as the drafter's training batch: `hidden` (1, T, n, d) holds the target's hidden
    states at `layers`, picked in the drafter's stored order."""
    import torch

    T = ids.shape[1]
    return {
        "hidden": hidden[:, :, [layers.index(layer) for layer in drafter.stored_layers]],
        "input_ids": ids,
        "position_ids": torch.arange(T)[None],
        "attention_mask": torch.ones(1, T, dtype=torch.long),
        "loss_mask": torch.ones(1, T),
    }


def fed_back_reference(drafter, features, next_ids, n: int):
    """Our drafting path (`drafter.step` with its KV cache, as evaluation drafts) one step past step 0, at the end of
    every prefix: step 0 runs over the whole sequence on the target's `features` (1, T, n_feat·d) and the next
    tokens (1, T); then for each t < n the cache is cut to positions 0..t and one step is fed the drafter's own
    output at t and its own top-1 token there (mapped to a target id), at position t+1, as an engine's proposer
    drafts its second token. Returns (tokens (n,), logits (n, V): over the draft vocabulary for EAGLE-3)."""
    import torch

    from methods.eagle2.model import DraftCache

    T = next_ids.shape[1]
    positions = torch.arange(T)[None]
    cache = drafter.new_cache()
    with torch.no_grad():
        logits, hidden = drafter.step(features, next_ids, positions, cache)  # step 0: (1, T, V|K), (1, T, d)
        top1 = logits[0, :n].argmax(-1)
        tokens = drafter.draft_ids[top1] if drafter.cfg.method == "eagle3" else top1
        fed = []
        for t in range(n):
            prefix = DraftCache(list(cache.keys), list(cache.values))
            prefix.crop(t + 1)
            step, _ = drafter.step(
                hidden[:, t : t + 1], tokens[t].view(1, 1), positions[:, t : t + 1] + 1, prefix, from_target=False
            )
            fed.append(step[0, 0])
    return tokens, torch.stack(fed).float()


def parallel_reference(drafter, features, ids, n: int):
    """A P-EAGLE drafter's drafting (`eval.static_proposers.ParallelProposer`, one forward per round) at the end
    of every prefix: for each t < n, a fresh proposer's forward over the real positions 0..t (the target's
    `features` (1, T, n_feat, d) in `cfg.feature_layers` order, the next tokens ids[1..t+1]) and its
    `parallel_tokens - 1` mask slots at positions t+1.. . Returns (n, parallel_tokens, K) logits over the draft
    vocabulary: row t's depth 0 is the last real position's, depth j mask slot j's."""
    import torch

    from eval.proposal import DecodeState, VocabProjection
    from eval.static_proposers import ParallelProposer
    from eval.trees import chain

    vocab = VocabProjection.trained(drafter.lm_head, drafter.draft_ids, drafter.target_vocab_size)
    proposer = ParallelProposer(drafter, chain(drafter.cfg.parallel_tokens), vocab)
    out = []
    with torch.no_grad():
        for t in range(n):
            proposer.reset(1)  # the root ids[t+1] follows the prefix whose features are new
            state = DecodeState(tokens=ids[:, : t + 2], new_hidden=features[:, : t + 1])
            out.append(vocab(proposer.forward([state]))[0])  # (parallel_tokens, K)
    return torch.stack(out).float()


def prepare(out: Path, rope_theta: float | None, dynamic: bool = False) -> None:
    sys.path.insert(0, str(ROOT))  # run as a script from the repository root's environment
    import torch
    from safetensors.torch import save_file

    os.chdir(ROOT)
    out.mkdir(parents=True, exist_ok=True)
    target_dir = tiny_target(out, "recipes/tiny/eagle2.yaml", rope_theta, dynamic)
    eagle_extra = ["drafter.fc_norm=false", "drafter.post_norm=false"]
    medusa_extra = [f"drafter.num_heads={MEDUSA_HEADS}", "drafter.num_layers=1"]
    target, eagle = train_and_export(
        out / "eagle", target_dir, "recipes/tiny/eagle2.yaml", eagle_extra, "eagle", include_target_weights=True
    )
    _, medusa = train_and_export(out / "medusa", target_dir, "recipes/tiny/medusa1.yaml", medusa_extra, "medusa")

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, SEQ_LEN), generator=gen)
    with torch.no_grad():
        hidden = target.hidden_states(ids, torch.ones_like(ids), layers=[-1])[:, :, 0].float()  # (1, T, d)
        next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # x_{t+1} beside f_t, as EAGLE reads them
        batch = drafter_batch(eagle, ids, hidden[:, :, None], [-1])
        eagle_reference = eagle.logits(eagle.predict_features(batch))
        medusa_reference = medusa.head_logits(hidden)  # (heads, 1, T, V)
    tensors = {
        "input_ids": ids,
        "next_ids": next_ids,
        "hidden": hidden.contiguous(),
        "eagle_reference": eagle_reference.float().contiguous(),
        "medusa_reference": medusa_reference.float().contiguous(),
    }
    save_file(tensors, str(out / "inputs.safetensors"))
    rope = "dynamic NTK, factor 4, 8 positions" if dynamic else f"rope_theta {rope_theta or 'default'}"
    print(f"prepared {out}: target RoPE {rope}, eagle and medusa exports, T={SEQ_LEN}")


def consume(out: Path) -> LogitDiffs:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers
    from eagle.model.ea_model import EaModel
    from logit_diffs import LogitDiffs  # beside this script, on sys.path when it runs as one
    from medusa.model.medusa_model import MedusaModel
    from safetensors.torch import load_file

    inputs = load_file(str(out / "inputs.safetensors"))
    target = out / "target"
    print(f"transformers {transformers.__version__}; target {target}")
    diffs = LogitDiffs(width=34)

    # SafeAILab eagle-llm 1.2.1: its from_pretrained, then its drafter on our features and the next tokens
    model = EaModel.from_pretrained(
        base_model_path=str(target), ea_model_path=str(out / "eagle" / "export"), torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():
        h = model.ea_layer(hidden_states=inputs["hidden"], input_ids=inputs["next_ids"])
        diffs.compare("eagle-llm EaModel.ea_layer", model.base_model.lm_head(h), inputs["eagle_reference"])

    # FasterDecoding medusa-llm 0.1: its from_pretrained and forward (its base model computes the hidden states)
    model = MedusaModel.from_pretrained(str(out / "medusa" / "export"), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=inputs["input_ids"])  # (heads, 1, T, V)
    reference = inputs["medusa_reference"]
    if logits.shape != reference.shape:
        print(f"medusa-llm MedusaModel.forward: logits {tuple(logits.shape)}, ours {tuple(reference.shape)}")
        diffs.fail("medusa")
    else:
        for k in range(reference.shape[0]):
            diffs.compare(f"medusa-llm MedusaModel.forward head {k}", logits[k], reference[k])
        with torch.no_grad():  # the loaded heads alone, on our target's hidden states
            for k in range(reference.shape[0]):
                diffs.compare(f"medusa-llm medusa_head[{k}]", model.medusa_head[k](inputs["hidden"]), reference[k])

    return diffs


def verdict(diffs: LogitDiffs, rope_base_10000: bool) -> bool:
    """The goal line. Normally every comparison must pass. With `rope_base_10000` (a target whose `rope_theta` is
    not 10000) the releases must show what their RoPE costs: the Medusa heads still match on our hidden states (the
    export is right), but the EAGLE drafter and Medusa's forward through its own base model do not."""
    results = diffs.results
    if not results or not rope_base_10000:  # nothing compared cannot pass
        return diffs.goal_line("consumers/max_abs_logit_diff", GOAL) <= GOAL
    heads = [v for k, v in results.items() if "medusa_head[" in k]
    rope = [v for k, v in results.items() if "medusa_head[" not in k]
    confirmed = bool(heads) and max(heads) <= GOAL and bool(rope) and min(rope) > GOAL
    print(
        f"heads on our hidden states: max {max(heads, default=math.inf):.2e}; "
        f"through the releases' RoPE: min {min(rope, default=0.0):.2e}"
    )
    print(f"consumers/rope_base_10000_confirmed: {'yes' if confirmed else 'no'} (goal = yes)")
    return confirmed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["prepare", "consume"])
    parser.add_argument("out", type=Path)
    rope = parser.add_mutually_exclusive_group()
    rope.add_argument("--rope-theta", type=float, default=None, help="prepare: the tiny target's RoPE base")
    rope.add_argument("--rope-dynamic", action="store_true", help="prepare: dynamic NTK RoPE scaling on the target")
    parser.add_argument(
        "--expect-rope-base-10000",
        action="store_true",
        help="consume: the target's rope_theta is not 10000; pass if the releases' base-10000 RoPE shows and only it",
    )
    args = parser.parse_args(argv)
    if args.stage == "prepare":
        prepare(args.out.resolve(), args.rope_theta, args.rope_dynamic)
    else:
        sys.exit(0 if verdict(consume(args.out.resolve()), args.expect_rope_base_10000) else 1)


if __name__ == "__main__":
    main()
