"""What the vLLM and SGLang checks (`vllm_check.py`, `sglang_check.py`) share on the engine side: the attention
stand-in with the KV cache an engine keeps, and the aux layer id edit of their negative case.

Imports only torch and the standard library, so every engine's virtual environment can use it (the checks put this
directory on `sys.path` in their consume stage) and the project's tests can import it as `benchmarks.engine_side`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

AUX_IDS = "eagle_aux_hidden_state_layer_ids"
CAPTURED = {"vllm": (0, 1), "sglang": (0, 2)}
"""engine -> (lowest id, L - highest id) it captures of an L-layer target: vLLM id i = the input of decoder layer i
(0..L-1), SGLang id i = the output of decoder layer i (0..L-2); `methods.eagle3.layouts.aux_layer_ids` has the same."""


class CachedCausalAttention:
    """Plain causal attention over one sequence, keeping each layer's keys and values as an engine's KV cache does.

    A call with n new tokens on top of S cached ones attends from new token i to the cached ones and to new tokens
    0..i, then appends the new keys and values: an extend (prefill) over a sequence is one call on an empty cache,
    and a draft step fed back at the end of a prefix of length P is `restore(saved, P)` (the extend's cache cut to
    its first P positions) and a call with its one token, which attends to those P positions and to itself, as the
    engines' proposers run their next draft step. Layers are keyed by the attention module that calls (one instance
    per model)."""

    def __init__(self) -> None:
        self.kv: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer, q, k, v, num_heads: int, num_kv_heads: int, scale: float) -> torch.Tensor:
        """q (n, H·hd), k (n, Hkv·hd), v (n, Hkv·hdv) -> (n, H·hdv)."""
        n = q.shape[0]
        heads = ((q, num_heads), (k, num_kv_heads), (v, num_kv_heads))
        q, k, v = (x.reshape(n, h, -1).transpose(0, 1) for x, h in heads)
        if layer in self.kv:
            past_k, past_v = self.kv[layer]
            k, v = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)
        self.kv[layer] = (k, v)
        S = k.shape[1] - n
        mask = torch.arange(S + n, device=q.device)[None] <= torch.arange(n, device=q.device)[:, None] + S
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.transpose(0, 1).reshape(n, -1)

    def save(self) -> dict:
        """The cache as it is now (tensors are never written in place: later calls leave it as it was)."""
        return dict(self.kv)

    def restore(self, saved: dict, length: int) -> None:
        """The `saved` cache cut to its first `length` positions in every layer."""
        self.kv = {layer: (k[:, :length], v[:, :length]) for layer, (k, v) in saved.items()}

    def clear(self) -> None:
        self.kv = {}


def shifted_aux_ids(ids: list[int], lo: int, hi: int) -> list[int]:
    """`ids` (in layer order) with one id moved by 1, staying in lo..hi and distinct from the others, so the edited
    export is one the engine loads and captures the same number of hidden states for, only one of them another
    layer's: the first id that can move up moves up, else the first that can move down moves down."""
    for delta in (1, -1):
        for i, layer in enumerate(ids):
            moved = layer + delta
            if lo <= moved <= hi and moved not in ids:
                return [*ids[:i], moved, *ids[i + 1 :]]
    raise ValueError(f"aux layer ids {ids}: none can move by 1 within {lo}..{hi} without naming another's layer")


def aux_id_places(config: dict) -> list[dict]:
    """The dicts of an EAGLE-3 export's config.json that hold `eagle_aux_hidden_state_layer_ids`: the top level (the
    speculators config vLLM reads) and/or `eagle_config` (SGLang's and vLLM's other place)."""
    places = [config] if AUX_IDS in config else []
    if isinstance(config.get("eagle_config"), dict) and AUX_IDS in config["eagle_config"]:
        places.append(config["eagle_config"])
    return places


def edit_aux_ids(config: dict, num_layers: int, engine: str) -> tuple[list[int], list[int]]:
    """Shift one aux layer id of `config` in place (every place it is written, so whichever the engine reads sees
    it), within what `engine` captures of a `num_layers`-layer target; returns (ids before, ids after)."""
    places = aux_id_places(config)
    if not places:
        raise ValueError(f"config.json has no {AUX_IDS} (top level or eagle_config)")
    before = list(places[0][AUX_IDS])
    if any(list(place[AUX_IDS]) != before for place in places):
        raise ValueError(f"config.json: {AUX_IDS} differ between the top level and eagle_config")
    lo, below_top = CAPTURED[engine]
    after = shifted_aux_ids(before, lo, num_layers - below_top)
    for place in places:
        place[AUX_IDS] = list(after)
    return before, after


def copy_with_edited_aux_ids(export: Path, dest: Path, num_layers: int, engine: str) -> tuple[list[int], list[int]]:
    """Copy the export directory to `dest` (replaced) with one aux layer id shifted in its config.json (the tensors
    are the same files); returns (ids before, ids after)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(export, dest)
    config = json.loads((dest / "config.json").read_text())
    before, after = edit_aux_ids(config, num_layers, engine)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return before, after
