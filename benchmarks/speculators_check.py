"""The real consumer: the `speculators` package loads a `speculators` export and must give our draft logits.

    make check-speculators          # builds .venv-speculators (speculators 0.9.0, its own transformers) and runs
                                    # EAGLE-3, EAGLE-3.1 and P-EAGLE (plain and with FC-Norm), and multi-layer
                                    # EAGLE-3.1 (2 layers) and P-EAGLE (3 layers)
    .venv/bin/python benchmarks/speculators_check.py prepare OUT [OVERRIDES...] [--method eagle3|peagle]
                                    [--run RUN_DIR] [--steps 3]
    .venv-speculators/bin/python benchmarks/speculators_check.py consume OUT

`prepare` (project environment) exports an `eagle3` run (default: trains recipes/tiny/eagle3.yaml for a few steps
under OUT/run) with `python -m export --format speculators` into OUT/export, runs the target on one sequence
and writes OUT/inputs.safetensors: the fused hidden states as speculators reads them (`aux`, (1, T, 3·d) in
`eagle_aux_hidden_state_layer_ids` order), the next tokens (`input_ids`, x_{t+1} at t), 0-based positions and our
drafter's training-time-test logits for each unrolled step (`reference_<j>`, (1, T, K)). `--method peagle` trains
recipes/tiny/peagle.yaml instead and writes our one-forward drafting at the end of every prefix 0..t
(`parallel_reference`, (T-1, K, draft vocabulary): `eval.static_proposers.ParallelProposer` over the real positions 0..t
and its K-1 mask slots).

`consume` (the speculators environment, which pins transformers <= 5.19, hence its own virtual environment) imports
nothing from this project. It builds speculators' `Eagle3DraftModel` from OUT/export twice: through
`SpeculatorModel.from_pretrained` (its loader; the verifier it insists on reading is a local stub holding the
target's embedding, since the package reads the verifier's config even when the export names it) and by
constructing the model from the export's config and loading the tensors strictly. It then runs speculators'
own forward for the same number of unrolled steps, capturing the LM head's output at each step, and compares with
`reference_<j>` at the positions whose step-j token exists. A `peagle` export is built as speculators'
`PEagleDraftModel` the same two ways; its forward (the package's training forward, its only one: real positions
plus mask-slot chains from its COD sampling, here with ratio 1, recorded as the model calls it) must give, at every
(anchor a, depth j) it lays out, `parallel_reference[a, j]` (see `parallel_forward`). Ends with
`speculators/max_abs_logit_diff: <x> (goal <= 0.0001)`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1e-4
ATTENTION = "eager"
"""speculators' default flex attention wants block-sized (128) sequences; eager attention computes the same."""


def prepare(out: Path, run: Path | None, steps: int, overrides: list[str], method: str = "eagle3") -> None:
    sys.path.insert(0, str(ROOT))  # run as a script from the repository root's environment
    import torch
    from safetensors.torch import save_file

    from benchmarks.consumers_check import parallel_reference
    from data.extract import main as extract_main
    from export.write import export, load_run
    from schema.recipe import load_recipe
    from train.loop import train

    out.mkdir(parents=True, exist_ok=True)
    if run is None:
        os.chdir(ROOT)
        run, features = out / "run", out / "features"
        recipe = str(ROOT / f"recipes/tiny/{method}.yaml")
        unrolled = [f"drafter.ttt_steps={steps}"] if method == "eagle3" else []
        common = [f"data.features_dir={features}", *unrolled, "logging.tracker=none", *overrides]
        if not (features / "manifest.json").is_file():
            extract_main([recipe, *common])
        if not (run / "recipe.yaml").is_file():
            train(load_recipe(recipe, [*common, f"train.output_dir={run}", "train.max_steps=6", "train.eval_every=0"]))
    exported = export(run, out / "export", fmt="speculators")
    recipe, target, drafter = load_run(run)
    method = recipe.drafter.method
    assert method in ("eagle3", "peagle"), f"{run}: an eagle3 or peagle run is needed, got {method}"
    gen = torch.Generator().manual_seed(0)
    T = 24
    ids = torch.randint(0, target.config.vocab_size, (1, T), generator=gen)
    layers = sorted(set(drafter.stored_layers))
    with torch.no_grad():
        hidden = target.hidden_states(ids.to(target.device), torch.ones_like(ids).to(target.device), layers=layers)
    hidden = hidden.float().cpu()  # (1, T, n, d)
    batch = {
        "input_ids": ids,
        "hidden": hidden[:, :, [layers.index(layer) for layer in drafter.stored_layers]],
        "position_ids": torch.arange(T)[None],
        "attention_mask": torch.ones(1, T, dtype=torch.long),
        "loss_mask": torch.ones(1, T),
    }
    drafter = drafter.float().eval()
    aux = batch["hidden"][:, :, [drafter.stored_layers.index(layer) for layer in drafter.cfg.feature_layers]]
    tensors = {
        "aux": aux.flatten(2).contiguous(),
        "input_ids": torch.cat([ids[:, 1:], ids[:, -1:]], dim=1),
        "positions": torch.arange(T)[None],
    }
    if drafter.cfg.method == "peagle":  # its drafting at the end of every prefix 0..t: (T - 1, K, draft vocabulary)
        tensors["parallel_reference"] = parallel_reference(drafter, aux, ids, T - 1).contiguous()
        what = f"{drafter.cfg.parallel_tokens} tokens per forward"
    else:
        with torch.no_grad():
            outputs = drafter.unroll(batch)
        tensors.update({f"reference_{j}": drafter.draft_logits(h).contiguous() for j, h in enumerate(outputs)})
        what = f"{len(outputs)} unrolled steps"
    save_file(tensors, str(out / "inputs.safetensors"))
    print(f"prepared {exported} and {out / 'inputs.safetensors'}: {drafter.cfg.method}, {what}, T={T}")


def consume(out: Path) -> float:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from safetensors.torch import load_file, save_file
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    export = out / "export"
    inputs = load_file(str(out / "inputs.safetensors"))
    tensors = load_file(str(export / "model.safetensors"))
    steps = sum(1 for k in inputs if k.startswith("reference_"))
    parallel = "parallel_reference" in inputs  # P-EAGLE
    config_class, model_class = (
        (PEagleSpeculatorConfig, PEagleDraftModel) if parallel else (Eagle3SpeculatorConfig, Eagle3DraftModel)
    )
    print(f"speculators {importlib.metadata.version('speculators')}: {export}")

    def strict() -> torch.nn.Module:
        config = config_class.from_pretrained(str(export))
        config.transformer_layer_config._attn_implementation = ATTENTION
        model = model_class(config)
        result = model.load_state_dict(tensors, strict=False)
        missing = {k for k in result.missing_keys if not k.startswith("verifier_")}
        if missing or result.unexpected_keys:
            raise SystemExit(f"error: {export}: missing {sorted(missing)}, unexpected {sorted(result.unexpected_keys)}")
        return model

    def from_pretrained(tmp: Path) -> torch.nn.Module:
        config = config_class.from_pretrained(str(export))
        layer = config.transformer_layer_config.to_dict()
        layer["num_hidden_layers"] = max(config.eagle_aux_hidden_state_layer_ids) + 1
        stub = tmp / "verifier"
        stub.mkdir()
        (stub / "config.json").write_text(json.dumps(layer, default=str))
        embed = tensors["embed_tokens.weight"]
        save_file(
            {
                "model.embed_tokens.weight": embed,
                "lm_head.weight": torch.zeros_like(embed),  # read into the training-only verifier head
                "model.norm.weight": torch.ones(embed.shape[1], dtype=embed.dtype),
            },
            str(stub / "model.safetensors"),
        )
        config.speculators_config.verifier.name_or_path = str(stub)
        config.transformer_layer_config._attn_implementation = ATTENTION
        return SpeculatorModel.from_pretrained(str(export), config=config)

    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for how, build in (("from_pretrained", lambda: from_pretrained(Path(tmp))), ("strict load", strict)):
            model = build().float().eval()
            print(f"{how}: {type(model).__module__}.{type(model).__name__}")
            if parallel:
                worst = max(worst, parallel_forward(model, inputs, how))
                continue
            captured: list[torch.Tensor] = []
            hook = model.lm_head.register_forward_hook(lambda m, i, o, out=captured: out.append(o.detach()))
            T = inputs["input_ids"].shape[1]
            with torch.no_grad():
                model(
                    hidden_states=inputs["aux"],
                    input_ids=inputs["input_ids"],
                    document_ids=torch.zeros(1, T, dtype=torch.long),
                    position_ids=inputs["positions"],
                    ttt_steps=steps,
                )
            hook.remove()
            for j in range(steps):
                n = T - 1 - j  # positions whose step-j token exists (the rest read padding, differently on each side)
                diff = (captured[j][0, :n] - inputs[f"reference_{j}"][0, :n]).abs().max().item()
                same = (captured[j][0, :n].argmax(-1) == inputs[f"reference_{j}"][0, :n].argmax(-1)).float().mean()
                print(f"{how:16s} step {j}: max |logit diff| {diff:.2e}, same top-1 at {same.item():.3f} of {n}")
                worst = max(worst, diff if math.isfinite(diff) else math.inf)  # nan logits fail
    if steps == 0 and not parallel:  # nothing compared cannot pass
        print("no reference_<step> logits in the prepared inputs")
        worst = math.inf
    print(f"speculators/max_abs_logit_diff: {worst:.2e} (goal <= {GOAL})")
    return worst


def parallel_forward(model, inputs: dict, how: str) -> float:
    """P-EAGLE: speculators' `PEagleDraftModel.forward` (its training forward, the package's only one) lays out the
    real positions (depth 0: the next tokens, the target's aux states) and, for sampled anchors a, mask slots at
    depth j = 1..K-1 (`mask_token_id`, `mask_hidden`, position a + j) that see the real positions 0..a and their own
    chain's slots up to j: one drafting forward per anchor, all in one sequence. Its COD sampling, run with ratio 1
    (every anchor whose depth-j position exists), is recorded as the model calls it; the LM head's output at
    (anchor a, depth j) must be our drafting at the end of prefix 0..a, `parallel_reference[a, j]`."""
    import speculators.models.peagle.core as core
    import torch
    from speculators.losses import resolve_loss_config

    reference = inputs["parallel_reference"]  # (T - 1, K, draft vocabulary)
    n, K = reference.shape[:2]
    T = inputs["input_ids"].shape[1]
    sampled: list[tuple[torch.Tensor, torch.Tensor]] = []
    cod = core.generate_cod_sample_indices

    def recorded(*args, **kwargs):
        anchor, depth = cod(*args, **kwargs)
        sampled.append((anchor, depth))
        return anchor, depth

    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    core.generate_cod_sample_indices = recorded
    loss_mask = torch.ones(1, T)
    loss_mask[0, 0] = 0  # position 0 is no depth-j target: speculators would anchor it at -1
    torch.manual_seed(0)  # which anchors each depth leaves out (d of them at ratio 1)
    try:
        with torch.no_grad():
            model(
                hidden_states=inputs["aux"],
                input_ids=inputs["input_ids"],
                document_ids=torch.zeros(1, T, dtype=torch.long),
                position_ids=inputs["positions"],
                loss_mask=loss_mask,
                verifier_last_hidden_states=torch.zeros(1, T, model.hidden_size),
                loss_config=resolve_loss_config("kl_div", "eager"),  # the default fused loss needs Triton
                num_depths=K,
                down_sample_ratio=1.0,
                down_sample_ratio_min=1.0,
            )
    finally:
        core.generate_cod_sample_indices = cod
        hook.remove()
    (anchor, depth), logits = sampled[0], captured[0][0]  # (S,), (S,), (S, draft vocabulary)
    worst = 0.0
    for j in range(K):
        keep = (depth == j) & (anchor < n)  # the last position's next token does not exist on our side
        a = anchor[keep]
        diff = (logits[keep] - reference[a, j]).abs().max().item()
        same = (logits[keep].argmax(-1) == reference[a, j].argmax(-1)).float().mean().item()
        what = "real positions" if j == 0 else f"mask slot {j}"
        print(f"{how:16s} depth {j} ({what}): max |logit diff| {diff:.2e}, same top-1 at {same:.3f} of {len(a)}")
        worst = max(worst, diff if math.isfinite(diff) and len(a) else math.inf)
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["prepare", "consume"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--run", type=Path, default=None, help="prepare: an eagle3 / peagle run (default: train one)")
    parser.add_argument("--method", choices=["eagle3", "peagle"], default="eagle3", help="prepare: the tiny run's")
    parser.add_argument("--steps", type=int, default=3, help="prepare: unrolled steps when training the tiny run")
    parser.add_argument("overrides", nargs="*", help="prepare: recipe overrides of the tiny run (drafter.fc_norm=true)")
    args = parser.parse_args(argv)
    if args.stage == "prepare":
        prepare(args.out.resolve(), args.run, args.steps, args.overrides, args.method)
    else:
        sys.exit(0 if consume(args.out.resolve()) <= GOAL else 1)


if __name__ == "__main__":
    main()
