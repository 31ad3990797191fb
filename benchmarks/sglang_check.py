"""SGLang's own model code loads our `--format sglang` exports (EAGLE-2 and EAGLE-3) and must give our draft logits.

    make check-sglang               # builds .venv-sglang and runs both
    .venv/bin/python benchmarks/sglang_check.py prepare OUT
    SGLANG_USE_CPU_ENGINE=1 .venv-sglang/bin/python benchmarks/sglang_check.py consume OUT

`prepare` (project environment) saves a tiny random 4-layer Llama target as OUT/target, trains an EAGLE-2 drafter
(no FC-Norm / post-norm: the EAGLE-1/2 layout holds neither) and an EAGLE-3 drafter (3 fused layers) on it for a few
steps, exports both with `--format sglang`, and writes OUT/inputs.safetensors: one random token sequence, the
target's hidden states on it (the last one for EAGLE-2; the fused ones, in layer order, for EAGLE-3), and our
drafters' logits on them (EAGLE-2 over the target vocabulary; EAGLE-3 over its draft vocabulary) with the EAGLE-3
drafter's target id of each draft token.

`consume` (SGLang's environment: the sglang 0.5.23 wheel on CPU torch) imports nothing from this project and runs
SGLang's code where it can on a CPU:
- the model class comes from SGLang's `ModelRegistry` through the export's `architectures`, the config from
  transformers' `AutoConfig` on the export, as SGLang builds a draft model;
- every parameter is filled with NaN, then SGLang's `load_weights` reads the export's tensors: a parameter it left
  NaN was not loaded (its loaders drop unknown names without an error), so every parameter but those SGLang's EAGLE
  worker takes from the target (`set_embed_and_head` for EAGLE-1/2, `set_embed` for EAGLE-3) must be covered;
- the target's embedding (and lm_head for EAGLE-1/2) are attached the way the worker does, and SGLang's
  `model.model(...)` runs on the same inputs (RoPE, norms, fc, MLP, its EAGLE-3 residual handling and
  `norm_output` choice), with plain causal attention over the sequence standing in for SGLang's attention backend,
  whose kernels need a GPU; EAGLE-3's `hot_token_id` (from `d2t`) must give our draft-to-target ids.

sglang's CPU engine imports `sgl_kernel` (CPU kernels are not on PyPI) and some of its multimodal helpers import
`torchvision` (whose PyPI build needs CUDA) at module level; both are replaced by recording stand-ins, and the
check fails if building, loading or running the drafters calls them, so the logits come from SGLang's PyTorch code
only. Ends with `sglang/max_abs_logit_diff: <x> (goal <= 0.0001)`.
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


def prepare(out: Path) -> None:
    sys.path.insert(0, str(ROOT))  # run as a script from the repository root's environment
    import torch
    from safetensors.torch import save_file

    from benchmarks.consumers_check import drafter_batch, tiny_target, train_and_export

    os.chdir(ROOT)
    out.mkdir(parents=True, exist_ok=True)
    target_dir = tiny_target(out, RECIPES["eagle3"])  # 4 layers: room for 3 fused ones
    eagle2_extra = ["drafter.fc_norm=false", "drafter.post_norm=false"]
    target, eagle2 = train_and_export(out / "eagle2", target_dir, RECIPES["eagle2"], eagle2_extra, "sglang")
    _, eagle3 = train_and_export(out / "eagle3", target_dir, RECIPES["eagle3"], [], "sglang")

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (1, SEQ_LEN), generator=gen)
    fused = sorted(eagle3.cfg.feature_layers)  # SGLang captures them in layer order
    layers = sorted({*fused, -1})
    with torch.no_grad():
        hidden = target.hidden_states(ids, torch.ones_like(ids), layers=layers).float()  # (1, T, n, d)
    next_ids = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # x_{t+1} beside the features of t
    with torch.no_grad():
        eagle2_reference = eagle2.logits(eagle2.predict_features(drafter_batch(eagle2, ids, hidden, layers)))
        # step 0: on the target's features
        eagle3_reference = eagle3.draft_logits(eagle3.unroll(drafter_batch(eagle3, ids, hidden, layers))[0])
    tensors = {
        "next_ids": next_ids[0],
        "positions": torch.arange(SEQ_LEN),
        "eagle2_hidden": hidden[0, :, layers.index(-1)].contiguous(),
        "eagle3_aux": hidden[0, :, [layers.index(layer) for layer in fused]].flatten(1).contiguous(),
        "eagle2_reference": eagle2_reference[0].float().contiguous(),
        "eagle3_reference": eagle3_reference[0].float().contiguous(),
        "eagle3_draft_ids": eagle3.draft_ids.contiguous(),
    }
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


def init_sglang() -> None:
    """A single CPU process (gloo, world size 1) with SGLang's parallel state and server arguments published."""
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

    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    if not model_parallel_is_initialized():
        reset_context()
        args = ServerArgs(model_path="dummy", device="cpu", tp_size=1, ep_size=1, pp_size=1)
        publish(args, role="test", ranks=SpawnRanks(world_rank=0))
        if parallel_state._WORLD is not None:
            get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")


class CausalAttention:
    """Plain causal attention over one sequence, no KV cache: what SGLang's attention backend computes for a
    single-sequence extend, without its GPU kernels."""

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        import torch.nn.functional as F

        T, H, KV = q.shape[0], layer.tp_q_head_num, layer.tp_k_head_num
        q, k, v = (x.view(T, n, -1).transpose(0, 1) for x, n in ((q, H), (k, KV), (v, KV)))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scaling, enable_gqa=True)
        return o.transpose(0, 1).reshape(T, -1)


class Batch:
    """The fields of SGLang's ForwardBatch that an EAGLE draft extend over one sequence reads; others are None."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __getattr__(self, name):
        return None


def consume(out: Path) -> float:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    install_stand_ins()
    import sglang
    import torch
    from logit_diffs import LogitDiffs  # beside this script, on sys.path when it runs as one
    from safetensors.torch import load_file
    from transformers import AutoConfig

    init_sglang()
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.models.registry import ModelRegistry

    for module in STAND_INS.values():  # importing touched them (transformers hashes torchvision's enum members)
        module.reset_mock()
    inputs = load_file(str(out / "inputs.safetensors"))
    target = load_file(str(out / "target" / "model.safetensors"))
    embed = target["model.embed_tokens.weight"]
    head = target.get("lm_head.weight", embed)
    print(f"sglang {sglang.__version__}: {out}")
    diffs = LogitDiffs()

    for method, shared in (
        ("eagle2", ("model.embed_tokens.weight", "lm_head.weight")),
        ("eagle3", ("model.embed_tokens.weight",)),
    ):
        export = out / method / "export"
        config = AutoConfig.from_pretrained(str(export))
        model_cls, arch = ModelRegistry.resolve_model_cls(config.architectures)
        torch.set_default_dtype(torch.float32)
        model = model_cls(config).eval()
        params = dict(model.named_parameters())
        with torch.no_grad():
            for p in params.values():
                p.fill_(math.nan)
        model.load_weights(iter(load_file(str(export / "model.safetensors")).items()))
        missing = sorted(n for n, p in params.items() if torch.isnan(p).any() and n not in shared)
        print(
            f"{method}: {arch} ({model_cls.__module__}); {len(params) - len(missing) - len(shared)} parameters loaded"
        )
        if missing:
            print(f"{method}: SGLang's load_weights left {missing} unloaded")
            diffs.fail(f"{method} coverage")
        if method == "eagle2":  # the EAGLE worker shares the target's embedding and lm_head
            model.set_embed_and_head(embed, head)
            hidden, ids = inputs["eagle2_hidden"], inputs["next_ids"]
        else:
            model.set_embed(embed)
            hidden, ids = inputs["eagle3_aux"], inputs["next_ids"]
            hot = model.get_hot_token_id()
            same_ids = hot is not None and torch.equal(hot.long(), inputs["eagle3_draft_ids"].long())
            print(f"eagle3: hot_token_id from d2t {'gives' if same_ids else 'DOES NOT give'} our draft-to-target ids")
            if not same_ids:
                diffs.fail("eagle3 hot_token_id")
        backend = CausalAttention()
        batch = Batch(
            forward_mode=ForwardMode.EXTEND,
            attn_backend=backend,
            spec_info=Batch(hidden_states=hidden),
            batch_size=1,
            input_ids=ids,
            positions=inputs["positions"],
            contains_mm_inputs=lambda: False,
        )
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
            h = model.model(ids, inputs["positions"], batch)
            h = h[0] if isinstance(h, tuple) else h  # EAGLE-3: (states to logits, [aux])
            logits = torch.nn.functional.linear(h, model.lm_head.weight)
        diffs.compare(f"{method} SGLang model.model", logits, inputs[f"{method}_reference"])

    calls = stand_in_calls()
    print(f"calls into the stand-in modules ({', '.join(sorted(STAND_INS)) or 'none imported'}): {calls or 'none'}")
    if calls:
        diffs.fail("stand-ins")
    return diffs.goal_line("sglang/max_abs_logit_diff", GOAL)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["prepare", "consume"])
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.stage == "prepare":
        prepare(args.out.resolve())
    else:
        sys.exit(0 if consume(args.out.resolve()) <= GOAL else 1)


if __name__ == "__main__":
    main()
