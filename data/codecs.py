"""How feature shards store hidden states (`data.storage_dtype`), and how readers decode them.

    codec = make_codec("fp8_e4m3", n_layers=4, hidden_size=576)
    parts = codec.encode(hidden)            # hidden (N, n, d) float -> {"hidden": ..., "hidden_scale": ...}, N rows
    again = codec.decode(parts)             # (N, n, d): float32 for encodings, the stored dtype for plain ones

Encodings (bytes per token for n stored layers of size d, ids and loss mask not counted):

- `bfloat16`, `float16`, `float32`: the values as they are, 2·n·d / 4·n·d bytes (`hidden [N, n·d]`). Decoding is a
  view: the loader hands the storage dtype to training, which casts.
- `fp8_e4m3`: every (token, layer) row scaled by its absolute maximum onto e4m3's ±448 (`hidden [N, n·d]`
  float8_e4m3fn, `hidden_scale [N, n]` float32): n·d + 4·n bytes, about half of bf16; 3 mantissa bits, so a
  relative RMS error of about 2.6%.
- `pca`: transform coding with a basis per layer fitted on the feature set's own hidden states and stored once beside
  the shards (`basis.safetensors`, its sha256 in the manifest): per layer, the principal axes of the fit tokens
  (mean removed, axes by falling variance), then each token's coefficients on them divided by one per-token scale
  (their RMS in units of each axis's standard deviation, `hidden_scale [N, n]` float16) and rounded by a uniform
  quantizer per axis whose bits come from a greedy allocation over the axes' variances (reverse water-filling:
  each next bit goes where it removes the most expected squared error, at most 8 per axis, none for axes whose
  variance is not worth one) and whose step is tuned on the fit tokens. The codes are packed end to end
  (`hidden [N, bytes]` uint8): `data.storage_bits` bits per value on average, the scale included (3.8: 0.24×
  bf16). Decoding unpacks the codes and does one (N, r) @ (r, d) product per layer, on whatever device the codes
  are on (the training device, through `data.loader.BatchLoader`).

A codec's `params` is what the manifest records under `encoding` (name, settings, and for `pca` the basis file with
its sha256 and size); the extraction header compares the settings, so features made with another encoding or other
settings are refused for reuse naming the field.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PLAIN_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ENCODINGS = ("fp8_e4m3", "pca")
"""Storage dtypes that are encodings: decoded to float32 by readers, recorded under the manifest's `encoding`."""
BASIS_FILE = "basis.safetensors"
FITTED_KEYS = ("basis", "basis_sha256", "basis_bytes", "fitted_tokens", "kept", "payload_bytes")
"""`encoding` fields that a fit produces (not settings): a resumed extraction compares the others first, then the
basis by its sha256."""

FP8_MAX = 448.0
SCALE_MIN = 2.0**-14  # float16's smallest normal: a per-token scale never rounds to 0
MAX_BITS = 8
# Uniform quantizers for a unit Gaussian with 2^b levels: the MSE-optimal step (Max 1960) and its distortion, the
# model under which bits are allocated; each axis's step is then tuned on the fit tokens from this start.
GAUSS_STEP = {1: 1.596, 2: 0.9957, 3: 0.5860, 4: 0.3352, 5: 0.1881, 6: 0.1041, 7: 0.0569, 8: 0.0308}
GAUSS_MSE = {0: 1.0, 1: 0.3634, 2: 0.1188, 3: 0.03744, 4: 0.01154, 5: 0.003490, 6: 0.001035, 7: 0.0003, 8: 0.0000871}
STEP_GRID = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4, 1.6, 1.8, 2.0, 2.4)
"""Multipliers of the Gaussian step tried per axis on the fit tokens (real coefficients have heavier tails)."""
MASSIVE_NORM = 4.0
"""Tokens above this multiple of a layer's median norm are left out of its pca mean (massive activations)."""


class Codec:
    """Plain storage in a float dtype; the base of the encodings."""

    name: str
    tensors: tuple[str, ...] = ("hidden",)
    zeros_decode_to_zero = True
    """All-zero stored tensors (a batch's padding) decode to zero states: a batch decodes whole, padding included."""

    def __init__(self, name: str, n_layers: int, hidden_size: int) -> None:
        self.name, self.n_layers, self.hidden_size = name, n_layers, hidden_size

    @property
    def encoded(self) -> bool:
        return self.name in ENCODINGS

    @property
    def dtype(self) -> torch.dtype:
        """The dtype readers get: the storage dtype for plain storage, float32 for an encoding."""
        return PLAIN_DTYPES[self.name]

    @property
    def bytes_per_token(self) -> int:
        """Shard bytes per token for the hidden states (scales included; ids, mask and a basis file not)."""
        return self.n_layers * self.hidden_size * PLAIN_DTYPES[self.name].itemsize

    def part_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each shard tensor's shape per token and its dtype."""
        return {"hidden": ((self.n_layers * self.hidden_size,), PLAIN_DTYPES[self.name])}

    def params(self) -> dict[str, Any] | None:
        """What the manifest records under `encoding` (None: plain storage, nothing beyond `dtype`)."""
        return None

    def to(self, device: torch.device | str) -> Codec:
        return self

    def encode(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """(N, n, d) float hidden states -> the shard tensors of those N tokens, on the same device."""
        return {"hidden": hidden.reshape(len(hidden), -1).to(PLAIN_DTYPES[self.name])}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The shard tensors of N tokens -> (N, n, d) hidden states, computed on the tensors' device."""
        hidden = parts["hidden"]
        return hidden.view(len(hidden), self.n_layers, self.hidden_size)


class Fp8Codec(Codec):
    """float8 e4m3 with one float32 scale per (token, layer) row: its absolute maximum / 448."""

    tensors = ("hidden", "hidden_scale")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def bytes_per_token(self) -> int:
        return self.n_layers * (self.hidden_size + 4)

    def part_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        n, d = self.n_layers, self.hidden_size
        return {"hidden": ((n * d,), torch.float8_e4m3fn), "hidden_scale": ((n,), torch.float32)}

    def params(self) -> dict[str, Any]:
        return {"name": self.name, "scale": "float32 per token and layer: absmax / 448", "payload_bytes":
                self.bytes_per_token}  # fmt: skip

    def encode(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        h = hidden.float()
        scale = (h.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # (N, n)
        q = (h / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"hidden": q.reshape(len(h), -1), "hidden_scale": scale}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        q, scale = parts["hidden"], parts["hidden_scale"]
        codes = q.reshape(-1).view(torch.uint8).to(torch.int32)  # the 256 values by table: 7x torch's cast on a CPU
        out = torch.index_select(_fp8_table(q.device), 0, codes).view(len(q), self.n_layers, self.hidden_size)
        return out.mul_(scale.float()[..., None])


_FP8_TABLES: dict[str, torch.Tensor] = {}


def _fp8_table(device: torch.device) -> torch.Tensor:
    """(256,) float32: the value of each e4m3 byte (torch's own conversion, NaN codes included)."""
    key = str(device)
    if key not in _FP8_TABLES:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        _FP8_TABLES[key] = codes.view(torch.float8_e4m3fn).float().to(device)
    return _FP8_TABLES[key]


def allocate_bits(variances: torch.Tensor, budget: int, max_bits: int = MAX_BITS) -> torch.Tensor:
    """Integer bits per axis (summing to at most `budget`) that minimise the expected squared error of uniform
    quantizers on Gaussian axes of these variances: each next bit goes to the axis whose error it cuts most (ties:
    the lower axis). (r,) int64."""
    var = [float(v) for v in variances]
    bits = [0] * len(var)
    heap = [(-v * (GAUSS_MSE[0] - GAUSS_MSE[1]), j) for j, v in enumerate(var)]
    heapq.heapify(heap)
    while budget > 0 and heap:
        _, j = heapq.heappop(heap)
        bits[j] += 1
        budget -= 1
        if bits[j] < max_bits:
            heapq.heappush(heap, (-var[j] * (GAUSS_MSE[bits[j]] - GAUSS_MSE[bits[j] + 1]), j))
    return torch.tensor(bits, dtype=torch.int64)


def _quantize(u: torch.Tensor, step: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Codes in [0, levels) of the mid-rise uniform quantizer: round-down of u / step, centred."""
    return (torch.floor(u / step) + levels / 2).clamp(min=0).minimum(levels - 1)


class PcaCodec(Codec):
    """Per-layer principal axes + per-token scale + bit-allocated uniform codes, packed (see the module docstring).

    Per layer i: `mean` (d,), `basis` (d, r) float16 (the kept axes, orthonormal up to float16), `sigma` (r,) the
    axes' standard deviations on the fit tokens, `step` (r,) each axis's quantizer step in coefficient units
    (before the token's scale), `bits` (r,) 1..8.
    """

    tensors = ("hidden", "hidden_scale")
    zeros_decode_to_zero = False  # zero codes are the axes' lowest levels, and the mean is added

    def __init__(self, layers: list[dict[str, torch.Tensor]], bits: Sequence[float], fit_tokens: int,
                 fitted_tokens: int) -> None:  # fmt: skip
        d = int(layers[0]["mean"].shape[0])
        super().__init__("pca", len(layers), d)
        self.layers = layers
        self.bits_setting = [float(b) for b in bits]
        self.fit_tokens, self.fitted_tokens = int(fit_tokens), int(fitted_tokens)
        all_bits = torch.cat([layer["bits"].long() for layer in layers])
        first = torch.cumsum(all_bits, 0) - all_bits  # each code's first bit in a token's bit string
        self.total_bits = int(all_bits.sum())
        self.payload = math.ceil(self.total_bits / 8)
        self._byte, self._shift = first // 8, (first % 8).to(torch.int32)
        self._mask = ((1 << all_bits) - 1).to(torch.int32)
        self._split = [int(layer["bits"].numel()) for layer in layers]
        self._device_cache: dict[str, PcaCodec] = {}
        self._prepare()

    def _prepare(self) -> None:
        """Decode-side folds: h = scale * (codes @ W + beta) + mean, with W = (basis * step)^T, beta the offsets."""
        self._basis, self._weight, self._beta = [], [], []
        for layer in self.layers:
            basis = layer["basis"].float()  # (d, r)
            levels = (1 << layer["bits"].long()).float()
            step = layer["step"].float()
            self._basis.append(basis)
            self._weight.append((basis * step).T.contiguous())  # (r, d)
            self._beta.append(basis @ ((0.5 - levels / 2) * step))  # (d,)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def bytes_per_token(self) -> int:
        return self.payload + 2 * self.n_layers

    def part_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"hidden": ((self.payload,), torch.uint8), "hidden_scale": ((self.n_layers,), torch.float16)}

    def params(self) -> dict[str, Any]:
        return {
            "name": "pca",
            "bits": self.bits_setting,
            "fit_tokens": self.fit_tokens,
            "fitted_tokens": self.fitted_tokens,
            "kept": self._split,
            "payload_bytes": self.bytes_per_token,
        }

    def to(self, device: torch.device | str) -> PcaCodec:
        key = str(torch.device(device))
        if key == str(self._mean_device()):
            return self
        if key not in self._device_cache:
            codec = PcaCodec.__new__(PcaCodec)
            codec.__dict__.update(self.__dict__)
            codec.layers = [{k: v.to(device) for k, v in layer.items()} for layer in self.layers]
            for name in ("_byte", "_shift", "_mask"):
                setattr(codec, name, getattr(self, name).to(device))
            codec._device_cache = {}
            codec._prepare()
            self._device_cache[key] = codec
        return self._device_cache[key]

    def _mean_device(self) -> torch.device:
        return self.layers[0]["mean"].device

    # ------------------------------------------------------------------------------------------- fit, save, load

    @classmethod
    def fit(cls, hidden: torch.Tensor, bits: Sequence[float], fit_tokens: int | None = None) -> PcaCodec:
        """Fit on (N, n, d) hidden states: per layer the principal axes (float64, eigenvectors with their largest
        entry positive: deterministic), the bit allocation for `bits[i]` bits per value (the token's float16 scale
        included; the last layer gives up the bits that would not fill a byte), and each axis's step, tuned over
        STEP_GRID on these tokens.

        Every token counts once, whatever its norm. Trained LLMs' middle layers carry "massive activations": on
        SmolLM2, 1% of the tokens (attention sinks) hold 95-99.6% of the energy of layers 15 and 27 at 160x the median
        norm. A plain covariance spends the bits on those few directions and leaves the ordinary tokens at 19% error
        (median, layer 15, 3.8 bits). So the mean is taken over tokens within MASSIVE_NORM x the median norm, the
        covariance over tokens scaled to unit RMS (the per-token scale restores their norm), and the steps minimise
        the error relative to each token: 5.4% then, the massive tokens at 3.6%."""
        N, n, d = hidden.shape
        if len(bits) != n:
            raise ValueError(f"pca: {len(bits)} bit settings for {n} stored layers")
        budgets = [math.floor(b * d) - 16 for b in bits]  # 16 bits of each layer's budget go to its scale
        budgets[-1] -= sum(budgets) % 8  # whole bytes within the budget: the codes are packed end to end
        layers = []
        for i in range(n):
            budget = budgets[i]
            if budget < 1:
                raise ValueError(f"pca: {bits[i]} bits per value leave no bits for {d} values after the scale")
            x = hidden[:, i]
            norms = torch.cat([chunk.double().norm(dim=-1) for chunk in x.split(8192)])
            ordinary = norms <= MASSIVE_NORM * norms.median()
            mean = torch.zeros(d, dtype=torch.float64)
            for chunk, keep in zip(x.split(8192), ordinary.split(8192)):
                mean += chunk.double()[keep].sum(0)
            mean /= max(int(ordinary.sum()), 1)
            cov = torch.zeros(d, d, dtype=torch.float64)
            squares = []
            for chunk in x.split(8192):
                c = chunk.double() - mean
                squares.append(c.pow(2).mean(-1, keepdim=True))
                c = c / squares[-1].sqrt().clamp_min(1e-12)  # unit RMS: every token counts once
                cov += c.T @ c
            # back in the units of a median token, so that its scale is about 1 and a massive one's fits float16
            cov *= torch.cat(squares).median() / max(N, 1)
            lam, vec = torch.linalg.eigh(cov)  # ascending
            lam, vec = lam.flip(0), vec.flip(1)
            signs = torch.sign(vec.gather(0, vec.abs().argmax(0, keepdim=True)))
            vec = vec * signs
            lam = lam.clamp_min(float(lam[0]) * 1e-12 + 1e-30)
            alloc = allocate_bits(lam, budget)
            keep = alloc > 0
            basis = vec[:, keep].to(torch.float16)  # stored as float16: encode with the rounded axes
            sigma = lam[keep].sqrt().float()
            b = alloc[keep]
            step = _tune_steps(x, mean.float(), basis.float(), sigma, b)
            layers.append({"mean": mean.float(), "basis": basis, "sigma": sigma, "step": step,
                           "bits": b.to(torch.uint8)})  # fmt: skip
        return cls(layers, bits, fit_tokens if fit_tokens is not None else N, N)

    def save(self, path: str | Path, fitted_for: str | None = None) -> None:
        """Write the basis; `fitted_for` (metadata) names what it was fitted for (extraction: its settings' hash)."""
        tensors = {f"layer{i}.{k}": v.contiguous().cpu() for i, layer in enumerate(self.layers) for k, v in
                   layer.items()}  # fmt: skip
        # one metadata key: safetensors writes several in a random order, and the file's bytes must not vary
        settings = {"bits": self.bits_setting, "fit_tokens": self.fit_tokens, "fitted_tokens": self.fitted_tokens}
        settings |= {} if fitted_for is None else {"fitted_for": fitted_for}
        save_file(tensors, str(path), metadata={"encoding": json.dumps(settings, sort_keys=True)})

    @classmethod
    def load(cls, path: str | Path) -> tuple[PcaCodec, dict[str, Any]]:
        """(codec, the settings the file records: bits, fit_tokens, fitted_tokens, fitted_for when extraction wrote
        it). Raises ValueError (or safetensors' error) on a file that is not a basis."""
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            n = len({k.split(".")[0] for k in keys})
            layers = [{k: f.get_tensor(f"layer{i}.{k}") for k in ("mean", "basis", "sigma", "step", "bits")}
                      for i in range(n)]  # fmt: skip
        settings = json.loads(meta["encoding"])
        return cls(layers, settings["bits"], settings["fit_tokens"], settings["fitted_tokens"]), settings

    # ------------------------------------------------------------------------------------------- encode, decode

    def encode(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        codec = self.to(hidden.device)
        h = hidden.float()
        codes, scales = [], []
        for i, layer in enumerate(codec.layers):
            c = (h[:, i] - layer["mean"]) @ codec._basis[i]  # (N, r) coefficients
            scale = (c / layer["sigma"]).pow(2).mean(-1).sqrt().to(torch.float16).float().clamp_min(SCALE_MIN)
            levels = (1 << layer["bits"].long()).float()
            codes.append(_quantize(c / scale[:, None], layer["step"].float(), levels))
            scales.append(scale)
        q = torch.cat(codes, 1).to(torch.int32)  # (N, R)
        return {"hidden": codec._pack(q), "hidden_scale": torch.stack(scales, 1).to(torch.float16)}

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        """(N, R) codes -> (N, payload) uint8: code j at bit `first[j]` of the token's little-endian bit string."""
        N, R = q.shape
        shifted = q << self._shift  # at most 15 bits: a code spans two bytes at most
        out = torch.zeros(N, self.payload + 1, dtype=torch.int32, device=q.device)
        out.scatter_add_(1, self._byte.expand(N, R), shifted & 0xFF)  # codes do not overlap: add is or
        out.scatter_add_(1, (self._byte + 1).expand(N, R), shifted >> 8)
        return out[:, : self.payload].to(torch.uint8)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(N, payload) uint8 -> (N, R) int32 codes."""
        codec = self.to(packed.device)
        # int16 halves the memory traffic (2x on a CPU); a code's bits lie in bits 0..14 of its window (shift <= 7,
        # width <= 8), below the sign bit that a high byte >= 128 sets
        p = torch.nn.functional.pad(packed, (0, 1)).to(torch.int16)
        windows = p[:, :-1] | (p[:, 1:] << 8)  # (N, payload): the 16 bits from each byte on
        return (windows.index_select(1, codec._byte).to(torch.int32) >> codec._shift) & codec._mask

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        packed, scale = parts["hidden"], parts["hidden_scale"].float()
        codec = self.to(packed.device)
        q = codec.unpack(packed).float()
        out = torch.empty(len(packed), self.n_layers, self.hidden_size, device=packed.device)
        for i, codes in enumerate(q.split(codec._split, dim=1)):
            out[:, i] = torch.addmm(codec._beta[i], codes, codec._weight[i]).mul_(scale[:, i : i + 1])
            out[:, i] += codec.layers[i]["mean"]
        return out


def _tune_steps(x: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor, sigma: torch.Tensor, bits: torch.Tensor):
    """Each axis's step (coefficient units): the Gaussian step for its bits times the STEP_GRID multiplier with the
    least squared error on these tokens (x: (N, d))."""
    gauss = torch.tensor([GAUSS_STEP[int(b)] for b in bits])
    levels = (1 << bits).float()
    errors = torch.zeros(len(STEP_GRID), len(bits), dtype=torch.float64)
    for chunk in x.split(4096):
        c = (chunk.float() - mean) @ basis
        scale = (c / sigma).pow(2).mean(-1).sqrt().to(torch.float16).float().clamp_min(SCALE_MIN)
        u = c / (scale[:, None] * sigma)  # unit-variance coefficients of unit-scale tokens
        for g, m in enumerate(STEP_GRID):  # the error relative to each token: massive tokens do not decide the steps
            step = gauss * m
            back = (_quantize(u, step, levels) - levels / 2 + 0.5) * step
            errors[g] += (back - u).pow(2).sum(0).double()
    best = torch.tensor(STEP_GRID)[errors.argmin(0)]
    return (gauss * best * sigma).float()


def make_codec(name: str, n_layers: int, hidden_size: int) -> Codec:
    """The codec of a storage dtype that needs no fit (plain dtypes, fp8_e4m3); `pca` codecs are fitted or loaded."""
    if name in PLAIN_DTYPES:
        return Codec(name, n_layers, hidden_size)
    if name == "fp8_e4m3":
        return Fp8Codec(name, n_layers, hidden_size)
    raise ValueError(f"storage dtype {name!r} is fitted on the data (PcaCodec.fit) or read from its basis file")


def bits_per_layer(bits: float | Sequence[float], n_layers: int) -> list[float]:
    """`data.storage_bits` as one value per stored layer."""
    return [float(b) for b in bits] if isinstance(bits, (list, tuple)) else [float(bits)] * n_layers


def encoding_settings(dtype: str, bits: float | Sequence[float], fit_tokens: int, n_layers: int) -> dict | None:
    """The extraction header's `encoding` settings for a storage dtype that is fitted (pca), else None."""
    if dtype != "pca":
        return None
    return {"name": "pca", "bits": bits_per_layer(bits, n_layers), "fit_tokens": int(fit_tokens)}


def relative_rms(decoded: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """Per layer: RMS of the error over RMS of the reference, over all tokens ((N, n, d) each)."""
    err = (decoded.float() - reference.float()).pow(2).sum((0, 2))
    ref = reference.float().pow(2).sum((0, 2)).clamp_min(1e-30)
    return (err / ref).sqrt().tolist()
