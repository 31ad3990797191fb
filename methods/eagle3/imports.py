"""SafeAILab / SGLang EAGLE-3 (`--format eagle3`) and speculators (`--format speculators`) checkpoints imported as
native eagle3 drafters, checked against the layout's reader."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from export.imports import check_close, check_tensors, int_field
from methods.eagle2.gates import rope_hints
from methods.eagle3 import gates as eagle3_gates
from methods.eagle3.config import Eagle3Config
from methods.eagle3.gates import compare
from methods.eagle3.model import Eagle3Drafter
from models.io import (
    ExportError,
    legacy_rope,
)


def import_eagle3(config: dict, tensors: dict[str, torch.Tensor], weights: Path, target, speculators: bool):
    """A SafeAILab / SGLang EAGLE-3 checkpoint (`midlayer.*`; aux ids from `eagle_config` in SGLang's numbering, else
    the consumers' default low/mid/high) or a speculators one (`layers.0.*`, `layers.1.*`, ... when it has more
    decoder layers; its flags) -> (Eagle3Drafter, reader)."""
    reader = eagle3_gates.SPECULATORS if speculators else eagle3_gates.SGLANG
    where = weights.parent / "config.json"
    layer = config.get("transformer_layer_config") if speculators else config
    if not isinstance(layer, dict):
        raise ExportError(f"{where}: transformer_layer_config: expected an object, got {layer!r}")
    tc = target.config
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if layer.get(key) != getattr(tc, key):
            raise ExportError(f"{where}: {key} is {layer.get(key)!r}, the target's is {getattr(tc, key)!r}")
    n_layers = layer.get("num_hidden_layers", 1)
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ExportError(f"{where}: num_hidden_layers: expected an integer >= 1, got {n_layers!r}")
    if n_layers != 1 and not speculators:
        raise ExportError(f"{where}: num_hidden_layers is {n_layers}: SGLang's EAGLE-3 layout has one decoder layer")
    check_layer_fields(layer, tc, where)
    K = int_field(config, "draft_vocab_size", None, where)
    L = tc.num_hidden_layers
    eagle_config = config.get("eagle_config") or {}
    if not isinstance(eagle_config, dict):
        raise ExportError(f"{where}: eagle_config: expected an object, got {eagle_config!r:.80}")
    ids = (config.get("eagle_aux_hidden_state_layer_ids") if speculators else None) or eagle_config.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if ids:
        check_aux_ids(ids, L, reader, where)
    # the engines capture each listed layer once, in layer order, and fuse them in that order
    layers = sorted({i + reader.aux_offset for i in ids}) if ids else [2, L // 2, L - 3]
    if speculators and "norm_before_residual" not in config:  # the two readers of this layout disagree here
        raise ExportError(
            f"{where}: no norm_before_residual: vLLM reads a missing one as true, the speculators package as false, "
            "so this drafter computes differently in each; add the value it was trained with"
        )
    flags = {k: bool(config.get(k, False)) for k in ("fc_norm", "norm_output", "norm_before_residual")}
    if not speculators and any(flags.values()):
        raise ExportError(f"{where}: {[k for k, v in flags.items() if v]}: SGLang's EAGLE-3 layout has no such flag")
    if config.get("norm_before_fc"):
        raise ExportError(f"{where}: norm_before_fc: not supported by the eagle3 method (use fc_norm)")
    cfg = Eagle3Config(feature_layers=layers, num_layers=n_layers, draft_vocab=K, ttt_steps=1, **flags)

    def err(key: str, msg: str) -> None:
        raise ExportError(f"{where}: {key} (from the checkpoint's config): {msg}")

    cfg.validate(err)
    drafter = Eagle3Drafter(cfg, target.parts([*layers, -1]))
    prefix = "layers.0." if speculators else "midlayer."
    ours = {name: tuple(t.shape) for name, t in drafter.trainable_state_dict().items()}
    expected = {n.replace("midlayer.", prefix, 1) if n.startswith("midlayer.") else n: v for n, v in ours.items()}
    if "d2t" not in tensors:
        raise ExportError(f"{weights}: no d2t (the draft vocabulary's offsets)")
    layout = f"{'a speculators' if speculators else 'an EAGLE-3'} drafter with draft_vocab_size={K}"
    check_tensors(tensors, expected, weights, layout, optional=("embed_tokens.weight",))
    if "embed_tokens.weight" in tensors and not torch.equal(
        tensors["embed_tokens.weight"].to(target.embed_tokens.weight.device),
        target.embed_tokens.weight.to(tensors["embed_tokens.weight"].dtype),  # the checkpoint's dtype (bf16 savers)
    ):
        raise ExportError(f"{weights}: embed_tokens.weight differs from the target's embedding (another target?)")
    draft_ids = torch.arange(K) + tensors["d2t"].to(torch.int64)
    if int(draft_ids.min()) < 0 or int(draft_ids.max()) >= tc.vocab_size or len(draft_ids.unique()) != K:
        raise ExportError(f"{weights}: d2t does not map {K} draft ids to distinct target ids (ids instead of offsets?)")
    t2d = torch.zeros(tc.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    if not torch.equal(tensors["t2d"].bool(), t2d):
        raise ExportError(f"{weights}: t2d does not mark exactly the target ids d2t maps to")
    drafter.set_draft_vocab(draft_ids, init_head=False)
    order = draft_ids.argsort()  # our draft ids are sorted by target id: reorder the head's rows the same way
    state = {n: tensors[e] for n, e in zip(ours, expected) if n not in ("d2t", "t2d")}
    state["lm_head.weight"] = state["lm_head.weight"][order]
    drafter.load_state_dict(state, strict=False)
    return drafter, reader


def import_safeailab(src: Path, config: dict, tensors: dict, weights: Path, target) -> tuple[nn.Module, Callable]:
    """A SafeAILab / SGLang EAGLE-3 checkpoint -> (Eagle3Drafter, the check of its reloaded native export)."""
    drafter, reader = import_eagle3(config, tensors, weights, target, speculators=False)
    return drafter, lambda native: check_eagle3(native, config, tensors, weights, target, reader)


def import_speculators(src: Path, config: dict, tensors: dict, weights: Path, target) -> tuple[nn.Module, Callable]:
    """A speculators EAGLE-3 checkpoint -> (Eagle3Drafter, the check of its reloaded native export)."""
    drafter, reader = import_eagle3(config, tensors, weights, target, speculators=True)
    return drafter, lambda native: check_eagle3(native, config, tensors, weights, target, reader)


def check_eagle3(native: nn.Module, config: dict, tensors: dict, weights: Path, target, reader) -> None:
    """The layout's reader on the source against the reloaded native drafter, on the same input."""
    result = compare(config, tensors, reader, target, native)
    check_close(result.consumer, result.reference, native, target, weights, reader.name, result.notes)


def check_layer_fields(layer: dict, tc, where: Path) -> None:
    """The decoder layer's config against the target's (the drafter runs with the target's): KV heads, head_dim,
    RMSNorm epsilon and RoPE, each named when it differs, before anything is computed."""
    integer, number, mapping = "an integer", "a number", "an object"
    for key, kinds, expected in (("num_key_value_heads", int, integer), ("head_dim", int, integer),
                                 ("rms_norm_eps", (int, float), number), ("rope_theta", (int, float), number),
                                 ("rope_scaling", dict, mapping), ("rope_parameters", dict, mapping)):  # fmt: skip
        value = layer.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise ExportError(f"{where}: {key}: expected {expected} or nothing, got {value!r:.80}")
    kv, target_kv = layer.get("num_key_value_heads"), getattr(tc, "num_key_value_heads", None)
    if (kv or layer["num_attention_heads"]) != (target_kv or tc.num_attention_heads):
        raise ExportError(f"{where}: num_key_value_heads is {kv!r}, the target's is {target_kv!r}")
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    if layer.get("head_dim", head_dim) != head_dim:
        raise ExportError(f"{where}: head_dim is {layer.get('head_dim')!r}, the target's is {head_dim}")
    eps = layer.get("rms_norm_eps")
    if eps is not None and not math.isclose(eps, tc.rms_norm_eps, rel_tol=1e-6):
        raise ExportError(f"{where}: rms_norm_eps is {eps!r}, the target's is {tc.rms_norm_eps!r}")
    view = dict(layer)
    if layer.get("rope_parameters") and "rope_theta" not in layer:  # transformers-5 fields only
        view.update(legacy_rope(layer))
    hints = rope_hints(view, tc)
    if hints:
        raise ExportError(f"{where}: {'; '.join(hints)}")


def check_aux_ids(ids, num_layers: int, reader: eagle3_gates.Eagle3Reader, where: Path) -> None:
    """eagle_aux_hidden_state_layer_ids: distinct integers the engine can capture (vLLM / speculators: inputs of
    layers 0..L-1; SGLang / SafeAILab: outputs of layers 0..L-2, the last one's reaching HF only after the norm)."""
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ExportError(f"{where}: eagle_aux_hidden_state_layer_ids: expected a list of integers, got {ids!r}")
    if len(set(ids)) != len(ids):
        raise ExportError(f"{where}: eagle_aux_hidden_state_layer_ids: {ids} names a layer twice")
    hi = num_layers - 1 - reader.aux_offset  # the last HF index an engine captures is L - 1
    bad = [i for i in ids if not 0 <= i <= hi]
    if bad:
        raise ExportError(
            f"{where}: eagle_aux_hidden_state_layer_ids: {bad} out of range: {reader.name} captures ids 0..{hi} of a "
            f"{num_layers}-layer target"
        )
