"""What every load gate builds its consumer from: the fixed input's size and seed, the result a gate returns,
parameters and config fields read with the consumer's fallbacks, and Llama's RMSNorm and RoPE as transformers-4
computes them; the files engine exports hold, and reading them as a loader does (`read_pt`: tensors only).

    p = Params(tensors, "model.safetensors", device, notes)   # p.get(name, shape): the consumer's tensor, or its init
    theta = config_value(config, "rope_theta", 10000.0, notes)  # a missing field: the consumer's default, noted
    cos, sin = rope_cos_sin(config, head_dim, positions, notes)

The consumers (`methods.eagle2.gates`, `methods.medusa1.gates`, `methods.eagle3.gates`) build on these; `export.gates`
holds the table of every gate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from models.io import ExportError, read_safetensors

GATE_BATCH, GATE_LEN, GATE_SEED = 2, 12, 1234
ROW_OFFSET = 1000
"""Positions of the gate's second row start here: a wrong RoPE base or scaling shows at large positions."""


@dataclass
class GateResult:
    consumer: torch.Tensor
    """Draft logits as the consumer computes them from the export, float32."""
    reference: torch.Tensor
    """The trained drafter's draft logits on the same input, float32."""
    notes: list[str] = field(default_factory=list)
    """What the consumer fell back on (defaults, random tensors, head counts): named in the error."""


class Params:
    """A consumer's parameters filled from a file: present tensors must have the shape it builds (else the load
    fails), absent ones keep the consumer's initialisation (noted), unknown ones are ignored."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str, device: torch.device, notes: list[str]):
        self.tensors, self.where, self.device, self.notes = tensors, where, device, notes
        self.gen = torch.Generator().manual_seed(GATE_SEED + 1)

    def get(self, name: str, shape: tuple[int, ...], init: str = "random") -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            self.notes.append(f"{name} missing from {self.where} (the consumer keeps its {init} initialisation)")
            if init == "ones":
                return torch.ones(shape, device=self.device)
            if init == "zeros":
                return torch.zeros(shape, device=self.device)
            return (torch.rand(shape, generator=self.gen) * 0.2 - 0.1).to(self.device)
        if tuple(t.shape) != tuple(shape):
            raise ExportError(
                f"{self.where}: {name} has shape {tuple(t.shape)}, the consumer builds {tuple(shape)} (load fails)"
            )
        return t.to(self.device, torch.float32)


def config_value(config: dict, key: str, default: Any, notes: list[str]) -> Any:
    if config.get(key) is None:
        if default is not None:
            notes.append(f"config.json has no {key} (the consumer uses {default})")
        return default
    return config[key]


def rope_cos_sin(
    config: dict,
    head_dim: int,
    positions: torch.Tensor,
    notes: list,
    scaled_reads_theta: bool = True,
    length_dependent_ntk: bool = False,
) -> tuple[torch.Tensor, ...]:
    """cos, sin (B, T, hd) as a transformers-4 Llama computes them from `rope_theta` and `rope_scaling`
    (`scaled_reads_theta=False`: scaled RoPE on base 10000, whatever `rope_theta` says, as SafeAILab builds it).

    Dynamic (NTK) scaling only for consumers that build it as transformers does (`length_dependent_ntk`): the base
    for the longest sequence of the batch, unchanged up to `max_position_embeddings`, computed afresh as a freshly
    loaded consumer does. vLLM and SGLang build it with one fixed base (which one depends on their version), so the
    drafter, trained with transformers' RoPE, would draft with another: refused."""
    scaling = config.get("rope_scaling")
    if scaling and not scaled_reads_theta:
        theta = 10000.0
        if config.get("rope_theta", theta) != theta:
            notes.append(f"rope_theta {config['rope_theta']!r} is ignored: scaled RoPE is built on base 10000")
    else:
        theta = float(config_value(config, "rope_theta", 10000.0, notes))
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else "default"
    if kind == "dynamic" and not length_dependent_ntk:
        raise ExportError(
            "config.json: rope_scaling type 'dynamic': this consumer builds NTK scaling with one fixed base (vLLM, "
            "SGLang), not the length-dependent base of transformers the drafter trained with (of the engine formats "
            "only --format eagle, for EAGLE-1/2 drafters, builds that one)"
        )
    if kind == "dynamic":  # NTK: the base grows once the sequence outgrows max_position_embeddings
        trained = int(config_value(config, "max_position_embeddings", 2048, notes))
        longest = max(int(positions.max()) + 1, trained)
        factor = scaling["factor"]
        theta = theta * ((factor * longest / trained) - (factor - 1)) ** (head_dim / (head_dim - 2))
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (hd/2,)
    if scaling:
        if kind == "linear":
            inv = inv / scaling["factor"]
        elif kind == "llama3":
            factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
            old = scaling["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old / low, inv / factor, inv)
            smooth = (old / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < old / high) * ~(wavelen > old / low)
            inv = torch.where(medium, smoothed, scaled)
        elif kind not in ("default", "dynamic"):
            raise ExportError(
                f"config.json: rope_scaling type {kind!r}: the load gate reproduces default, linear, dynamic and "
                "llama3 RoPE only (add it to export.gates.rope_cos_sin)"
            )
    inv = inv.to(positions.device)
    freqs = (inv[None, :, None].float() @ positions[:, None, :].float()).transpose(1, 2)  # (B, T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


MEDUSA_PT = "medusa_lm_head.pt"


EAGLE_PT = "pytorch_model.bin"


MEDUSA_SAFETENSORS = "medusa_lm_head.safetensors"


ENGINE_WEIGHTS = "model.safetensors"


FASTERDECODING_HEADS = 5
"""FasterDecoding Medusa's legacy loader builds this many heads whatever `medusa_num_heads` says."""


def same_tensors(out_dir: Path, safetensors_name: str, pt_name: str, fmt: str) -> dict[str, torch.Tensor]:
    """An export's safetensors file and its `.pt` copy (for loaders that read only that) hold the same tensors;
    returns them (each file read once)."""
    a, b = read_safetensors(out_dir / safetensors_name), read_pt(out_dir / pt_name)
    if a.keys() != b.keys() or any(not torch.equal(a[k], b[k]) for k in a):
        raise ExportError(f"{fmt} load gate: {safetensors_name} and {pt_name} hold different tensors")
    return b


def read_pt(path: Path) -> dict[str, torch.Tensor]:
    """A `.pt` state dict as `torch.load(path, weights_only=True)` reads it: tensors only, never arbitrary pickle."""
    if not path.is_file():
        raise ExportError(f"{path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle's, torch's or an OSError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"{path}: not loadable with torch.load(weights_only=True) ({first})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        raise ExportError(f"{path}: expected a dict of named tensors, got {type(state).__name__}")
    return state
