"""SGLang's own model code loads our `--format sglang` exports (EAGLE-2 and EAGLE-3) and, fed by its own target
model, must give our draft logits at step 0 and at the next draft step fed back.

    make check-sglang               # builds .venv-sglang and runs both, then the EAGLE-3 negative case
    .venv/bin/python benchmarks/sglang_check.py prepare OUT
    SGLANG_USE_CPU_ENGINE=1 .venv-sglang/bin/python benchmarks/sglang_check.py consume OUT [--edit-aux-ids]

`prepare` (project environment) saves a tiny random 5-layer Llama target as OUT/target (SGLang captures the outputs
of layers 0..3 of it: room for 3 fused states and for one shifted by 1), trains an EAGLE-2 drafter (no FC-Norm /
post-norm: the EAGLE-1/2 layout holds neither) and an EAGLE-3 drafter (3 fused layers) on it for a few steps,
exports both with `--format sglang`, and writes OUT/inputs.safetensors: one random token sequence, our target's
logits and hidden states on it (the last one for EAGLE-2; the fused ones, in layer order, for EAGLE-3), our
drafters' step-0 logits on them (EAGLE-2 over the target vocabulary; EAGLE-3 over its draft vocabulary) with the
EAGLE-3 drafter's target id of each draft token, and for each drafter the next draft step at the end of every
prefix 0..t, our drafting path (`drafter.step` with its KV cache) fed its own state at t and its own top-1 token
(`<method>_fed_ids`, target ids) at position t+1 (`<method>_fed_reference`).

`consume` (SGLang's environment: the sglang 0.5.23 wheel on CPU torch) imports nothing from this project and runs
SGLang's code where it can on a CPU:
- the server arguments of serving the target with the EAGLE-3 export (`speculative_algorithm="EAGLE3"`) are
  published, as a server process does;
- the target's class comes from SGLang's `ModelRegistry`, its weights through its `load_weights` (every parameter
  filled with NaN first must be written); its `model.model(...)` on the token sequence gives the target logits and
  EAGLE-2's features (its last hidden states); then what `ModelRunner.init_attention_backends` runs configures it,
  `resolve_spec_aux_hidden_state_config` (the ids from the draft's `eagle_config`) and
  `configure_aux_hidden_state_capture` (the target's `set_eagle3_layers_to_capture`, SGLang's id + 1), and its
  forward again gives the captured states, packed as its logits processor packs them (EAGLE-3's features);
- each drafter's class comes from the `ModelRegistry` through the export's `architectures`, the config from
  transformers' `AutoConfig` on the export, as SGLang builds a draft model; every parameter is filled with NaN, then
  SGLang's `load_weights` reads the export's tensors: every parameter but those SGLang's EAGLE worker takes from the
  target (`set_embed_and_head` for EAGLE-1/2, `set_embed` for EAGLE-3) must be written;
- the target's embedding (and lm_head for EAGLE-1/2) are attached the way the worker does, and SGLang's
  `model.model(...)` runs (RoPE, norms, fc, MLP, its EAGLE-3 residual handling and `norm_output` choice) at step 0
  on our features and on SGLang's target's, then as a decode at the end of every prefix 0..t: its own top-1 token
  (EAGLE-3: through `hot_token_id`, which must give our draft-to-target ids), which must be ours, at t+1 with the
  state it returned at t (EAGLE-3: its aux output). Plain causal attention with a KV cache
  (`engine_side.CachedCausalAttention`) stands in for SGLang's attention backend, whose kernels need a GPU.

sglang's CPU engine imports `sgl_kernel` (CPU kernels are not on PyPI) and some of its multimodal helpers import
`torchvision` (whose PyPI build needs CUDA) at module level; both are replaced by recording stand-ins, and the
check fails if building, loading or running the target or the drafters calls them, so the logits come from
SGLang's PyTorch code only. Ends with `sglang/max_abs_logit_diff: <x> (goal <= 0.0001)`.

`consume --edit-aux-ids` is the negative case: a copy of the EAGLE-3 export (OUT/eagle3/export-aux-edited) with one
`eagle_config.eagle_aux_hidden_state_layer_ids` entry shifted by 1, named in the server arguments and checked the
same way; it passes (`sglang/edited_aux_ids_caught: yes`) when the EAGLE-3 drafter still gives our logits on our
features but its steps on what SGLang's target captured under the edited ids miss the goal.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1e-4
SEQ_LEN = 24
RECIPES = {"eagle2": "recipes/tiny/eagle2.yaml", "eagle3": "recipes/tiny/eagle3.yaml"}
TARGET_LAYERS = 5


def prepare(out: Path) -> None:
    sys.path.insert(0, str(ROOT))  # run as a script from the repository root's environment
    import torch
    from safetensors.torch import save_file

    from benchmarks.consumers_check import drafter_batch, fed_back_reference, tiny_target, train_and_export

    os.chdir(ROOT)
    out.mkdir(parents=True, exist_ok=True)
    # 5 layers: SGLang captures the outputs of layers 0..3, room for the 3 fused ones and for one shifted by 1
    target_dir = tiny_target(out, RECIPES["eagle3"], num_layers=TARGET_LAYERS)
    eagle2_extra = ["drafter.fc_norm=false", "drafter.post_norm=false"]
    target, eagle2 = train_and_export(out / "eagle2", target_dir, RECIPES["eagle2"], eagle2_extra, "sglang")
    _, eagle3 = train_and_export(out / "eagle3", target_dir, RECIPES["eagle3"], [], "sglang")

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, SEQ_LEN), generator=gen)
    fused = sorted(eagle3.cfg.feature_layers)  # SGLang captures them in layer order
    layers = sorted({*fused, -1})
    with torch.no_grad():
        hidden = target.hidden_states(ids, torch.ones_like(ids), layers=layers).float()  # (1, T, n, d)
        target_logits = target.model(input_ids=ids).logits[0].float()  # (T, V)
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # x_{t+1} beside the features of t
    last, aux = hidden[:, :, layers.index(-1)], hidden[:, :, [layers.index(layer) for layer in fused]].flatten(2)
    with torch.no_grad():
        eagle2_reference = eagle2.logits(eagle2.predict_features(drafter_batch(eagle2, ids, hidden, layers)))
        # step 0: on the target's features
        eagle3_reference = eagle3.draft_logits(eagle3.unroll(drafter_batch(eagle3, ids, hidden, layers))[0])
    tensors = {
        "input_ids": ids[0],
        "next_ids": next_ids[0],
        "positions": torch.arange(SEQ_LEN),
        "target_logits": target_logits.contiguous(),
        "eagle2_hidden": last[0].contiguous(),
        "eagle3_aux": aux[0].contiguous(),
        "eagle2_reference": eagle2_reference[0].float().contiguous(),
        "eagle3_reference": eagle3_reference[0].float().contiguous(),
        "eagle3_draft_ids": eagle3.draft_ids.contiguous(),
    }
    for method, drafter, features in (("eagle2", eagle2, last), ("eagle3", eagle3, aux)):
        # the second draft token at the end of every prefix, fed the drafter's own output and token
        tokens, fed = fed_back_reference(drafter, features, next_ids, SEQ_LEN - 1)
        tensors[f"{method}_fed_ids"], tensors[f"{method}_fed_reference"] = tokens.contiguous(), fed.contiguous()
    save_file(tensors, str(out / "inputs.safetensors"))
    print(f"prepared {out}: sglang exports of an eagle2 and an eagle3 drafter (fused layers {fused}), T={SEQ_LEN}")


# --------------------------------------------------------------------------------------------
# The SGLang side


STAND_INS: dict[str, object] = {}
"""Module name -> the MagicMock standing in for it (its `mock_calls` record every call into it)."""


def install_stand_ins(prefixes: tuple[str, ...] = ("sgl_kernel", "torchvision")) -> None:
    """Import-time stand-ins for modules that cannot load on this CPU; `stand_in_calls()` lists what called them."""
    import importlib.abc
    import importlib.machinery
    from unittest import mock

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            module = mock.MagicMock(name=spec.name)
            module.__spec__, module.__path__, module.__version__, module.__file__ = spec, [], "0.0", None
            STAND_INS[spec.name] = module
            return module

        def exec_module(self, module):
            pass

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == p or name.startswith(p + ".") for p in prefixes):
                return importlib.machinery.ModuleSpec(name, Loader(), is_package=True)
            return None

    sys.meta_path.insert(0, Finder())


def stand_in_calls() -> list[str]:
    """Calls into the stand-ins since their last `reset_mock()`."""
    return sorted({f"{name}: {call}" for name, module in STAND_INS.items() for call in module.mock_calls})


def init_sglang(target: Path, eagle3_export: Path):
    """A single CPU process (gloo, world size 1) with SGLang's parallel state and the server arguments of serving
    `target` with the EAGLE-3 drafter `eagle3_export` published (what its runner reads the aux layer ids through);
    returns those server arguments."""
    import torch

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29641", "RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=str(target),
        device="cpu",
        tp_size=1,
        ep_size=1,
        pp_size=1,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=str(eagle3_export),
    )
    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    if not model_parallel_is_initialized():
        reset_context()
        publish(args, role="test", ranks=SpawnRanks(world_rank=0))
        if parallel_state._WORLD is not None:
            get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")
    return args


class CausalAttention:
    """SGLang's attention backend call answered by plain causal attention over one sequence with a KV cache
    (`engine_side.CachedCausalAttention`): what its backend computes for a single-sequence extend, and for a draft
    decode step over the cached positions, without its GPU kernels."""

    def __init__(self):
        from engine_side import CachedCausalAttention  # beside this script, on sys.path when it runs as one

        self.cache = CachedCausalAttention()

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.cache(layer, q, k, v, layer.tp_q_head_num, layer.tp_k_head_num, layer.scaling)


class Batch:
    """The fields of SGLang's ForwardBatch that an EAGLE draft extend over one sequence reads; others are None."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __getattr__(self, name):
        return None


def forward(model, backend, hidden, ids, positions, mode):
    """SGLang's `model.model` (the layers, without the logits processor) on one sequence: `hidden` is the
    `spec_info.hidden_states` of a draft model (None for the target). Returns its output, as the model returns it."""
    import torch
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    batch = Batch(
        forward_mode=mode,
        attn_backend=backend,
        spec_info=None if hidden is None else Batch(hidden_states=hidden),
        batch_size=1,
        input_ids=ids,
        positions=positions,
        contains_mm_inputs=lambda: False,
    )
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        return model.model(ids, positions, batch)


def load_checked(model, tensors: dict, shared: tuple[str, ...], diffs, what: str) -> None:
    """SGLang's `load_weights` into a model whose every parameter is NaN first: one it left NaN was not loaded (its
    loaders drop unknown names without an error), which fails the check unless `shared` (taken from the target)."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(math.nan)
    model.load_weights(iter(tensors.items()))
    missing = sorted(n for n, p in params.items() if torch.isnan(p).any() and n not in shared)
    print(f"{what} ({type(model).__module__}): {len(params) - len(missing) - len(shared)} parameters loaded")
    if missing:
        print(f"{what}: SGLang's load_weights left {missing} unloaded")
        diffs.fail(f"{what} coverage")


def consume(out: Path, edit_aux_ids: bool = False) -> dict[str, float]:
    """SGLang's code on the case in OUT; returns each comparison's max |logit difference| (inf: failed)."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    install_stand_ins()
    import sglang
    import torch
    from engine_side import copy_with_edited_aux_ids  # beside this script, on sys.path when it runs as one
    from logit_diffs import LogitDiffs
    from safetensors.torch import load_file
    from transformers import AutoConfig

    target_dir, eagle3_export = out / "target", out / "eagle3" / "export"
    target_config = AutoConfig.from_pretrained(str(target_dir))
    if edit_aux_ids:
        edited = out / "eagle3" / "export-aux-edited"
        before, after = copy_with_edited_aux_ids(eagle3_export, edited, target_config.num_hidden_layers, "sglang")
        print(f"negative case: {edited}, eagle_config.eagle_aux_hidden_state_layer_ids {before} -> {after}")
        eagle3_export = edited
    server_args = init_sglang(target_dir, eagle3_export)
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    for module in STAND_INS.values():  # importing touched them (transformers hashes torchvision's enum members)
        module.reset_mock()
    inputs = load_file(str(out / "inputs.safetensors"))
    target = load_file(str(target_dir / "model.safetensors"))
    embed = target["model.embed_tokens.weight"]
    head = target.get("lm_head.weight", embed)
    ids, positions, input_ids = inputs["next_ids"], inputs["positions"], inputs["input_ids"]
    n = SEQ_LEN - 1  # the prefixes whose next token exists
    print(f"sglang {sglang.__version__}: {out}")
    diffs = LogitDiffs(width=44)
    torch.set_default_dtype(torch.float32)

    # the target, built and loaded as SGLang loads a model directory, on the token sequence: its last hidden states
    # (EAGLE-2's features) and, once its runner's aux-hidden-state setup has run, the states it captures (EAGLE-3's)
    target_cls, target_arch = ModelRegistry.resolve_model_cls(target_config.architectures)
    target_model = target_cls(target_config).eval()
    load_checked(target_model, target, (), diffs, f"target: {target_arch}")
    backend = CausalAttention()
    last = forward(target_model, backend, None, input_ids, positions, ForwardMode.EXTEND)
    diffs.compare(
        "target logits", torch.nn.functional.linear(last, target_model.lm_head.weight), inputs["target_logits"]
    )
    # what ModelRunner.init_attention_backends does: the ids resolved from the draft's config, which the server
    # arguments name, then the target's set_eagle3_layers_to_capture (SGLang's id + 1)
    spec_aux = resolve_spec_aux_hidden_state_config(
        server_args=server_args,
        model_config=ModelConfig.from_server_args(server_args),
        spec_algorithm=SpeculativeAlgorithm.from_string(server_args.speculative_algorithm),
        is_draft_worker=False,
    )
    configure_aux_hidden_state_capture(
        model=target_model,
        eagle_use_aux_hidden_state=spec_aux.eagle_use_aux_hidden_state,
        eagle_aux_hidden_state_layer_ids=spec_aux.eagle_aux_hidden_state_layer_ids,
        dflash_use_aux_hidden_state=spec_aux.dflash_use_aux_hidden_state,
        dflash_target_layer_ids=spec_aux.dflash_target_layer_ids,
        is_dspark=spec_aux.is_dspark,
    )
    capture = list(target_model.model.layers_to_capture)
    print(
        f"the target captures the inputs of layers {capture} (eagle_aux_hidden_state_layer_ids "
        f"{spec_aux.eagle_aux_hidden_state_layer_ids} + 1, from the export)"
    )
    backend.cache.clear()
    output = forward(target_model, backend, None, input_ids, positions, ForwardMode.EXTEND)
    aux = pack_aux_hidden_states(output[1]) if isinstance(output, tuple) else None  # as its logits processor packs
    if aux is None or aux.shape != inputs["eagle3_aux"].shape:
        print(f"the target captured {0 if aux is None else aux.shape[-1] // last.shape[-1]} states, not 3")
        diffs.fail("aux capture")
        aux = inputs["eagle3_aux"] * math.nan
    d = last.shape[-1]
    print(f"last hidden state: max |diff| from our target's {(last - inputs['eagle2_hidden']).abs().max().item():.2e}")
    for i, layer in enumerate(capture):
        part = (aux[:, i * d : (i + 1) * d] - inputs["eagle3_aux"][:, i * d : (i + 1) * d]).abs().max().item()
        print(f"aux state {i} (input of layer {layer}): max |diff| from our target's {part:.2e}")
    engine_features = {"eagle2": last, "eagle3": aux}

    for method, shared in (
        ("eagle2", ("model.embed_tokens.weight", "lm_head.weight")),
        ("eagle3", ("model.embed_tokens.weight",)),
    ):
        export = out / method / "export" if method == "eagle2" else eagle3_export
        config = AutoConfig.from_pretrained(str(export))
        model_cls, arch = ModelRegistry.resolve_model_cls(config.architectures)
        model = model_cls(config).eval()
        load_checked(model, load_file(str(export / "model.safetensors")), shared, diffs, f"{method}: {arch}")
        if method == "eagle2":  # the EAGLE worker shares the target's embedding and lm_head
            model.set_embed_and_head(embed, head)
            ours, to_target = inputs["eagle2_hidden"], None
        else:
            model.set_embed(embed)
            ours, to_target = inputs["eagle3_aux"], model.get_hot_token_id()
            same_ids = to_target is not None and torch.equal(to_target.long(), inputs["eagle3_draft_ids"].long())
            print(f"eagle3: hot_token_id from d2t {'gives' if same_ids else 'DOES NOT give'} our draft-to-target ids")
            if not same_ids:
                diffs.fail("eagle3 hot_token_id")
        draft_backend = CausalAttention()

        def draft(hidden, token_ids, pos, mode, model=model, draft_backend=draft_backend):
            """One draft forward: logits (over the draft vocabulary for EAGLE-3) and the state fed to the next step
            (EAGLE-3: the pre- or post-norm output it returns as its aux state, packed as its logits processor packs
            it; EAGLE-1/2: its output)."""
            result = forward(model, draft_backend, hidden, token_ids, pos, mode)
            h, fed = (result[0], pack_aux_hidden_states(result[1])) if isinstance(result, tuple) else (result, result)
            return torch.nn.functional.linear(h, model.lm_head.weight), fed

        reference = inputs[f"{method}_reference"]
        logits, _ = draft(ours, ids, positions, ForwardMode.EXTEND)
        diffs.compare(f"{method} step 0 on our features", logits[:n], reference[:n])
        # step 0 on what SGLang's target computed, then the next draft step at the end of every prefix 0..t: the
        # drafter's own top-1 token (a target id: through hot_token_id for EAGLE-3) at t+1 with its own state at t,
        # a decode over its cached positions 0..t
        draft_backend.cache.clear()
        logits0, fed = draft(engine_features[method], ids, positions, ForwardMode.EXTEND)
        diffs.compare(f"{method} step 0 on SGLang's target's states", logits0[:n], reference[:n])
        saved = draft_backend.cache.save()
        top1 = logits0[:n].argmax(-1)
        tokens = top1 if to_target is None else to_target.long()[top1]
        same = (tokens == inputs[f"{method}_fed_ids"]).sum().item()
        print(f"{method}: draft tokens fed back: SGLang's top-1 is ours at {same} of {n} positions")
        if same != n:
            diffs.fail(f"{method} fed-back tokens")
        step1 = []
        for t in range(n):
            draft_backend.cache.restore(saved, t + 1)
            logits1, _ = draft(fed[t : t + 1], tokens[t : t + 1], positions[t : t + 1] + 1, ForwardMode.DECODE)
            step1.append(logits1[0])
        fed_reference = inputs[f"{method}_fed_reference"]
        diffs.compare(f"{method} step 1 fed back (own state, token)", torch.stack(step1), fed_reference)

    calls = stand_in_calls()
    print(f"calls into the stand-in modules ({', '.join(sorted(STAND_INS)) or 'none imported'}): {calls or 'none'}")
    if calls:
        diffs.fail("stand-ins")
    diffs.goal_line("sglang/max_abs_logit_diff", GOAL)
    return diffs.results


def edited_ids_caught(results: dict[str, float]) -> bool:
    """The negative case's verdict: the EAGLE-3 drafter still gives our logits on our features (the export is
    otherwise intact) while its draft steps on the states SGLang's target captured under the edited ids miss the
    goal."""
    own = [v for k, v in results.items() if k.startswith("eagle3 step 0 on our features")]
    engine = [v for k, v in results.items() if k.startswith("eagle3 step") and "our features" not in k]
    caught = bool(own) and max(own) <= GOAL and bool(engine) and min(engine) > GOAL
    print(f"sglang/edited_aux_ids_caught: {'yes' if caught else 'no'} (goal = yes)")
    return caught


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["prepare", "consume"])
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--edit-aux-ids",
        action="store_true",
        help="consume: the negative case, a copy of the EAGLE-3 export with one aux layer id shifted by 1; passes "
        "when the check fails on it",
    )
    args = parser.parse_args(argv)
    if args.stage == "prepare":
        prepare(args.out.resolve())
    elif args.edit_aux_ids:
        sys.exit(0 if edited_ids_caught(consume(args.out.resolve(), edit_aux_ids=True)) else 1)
    else:
        sys.exit(0 if max(consume(args.out.resolve()).values(), default=math.inf) <= GOAL else 1)


if __name__ == "__main__":
    main()
