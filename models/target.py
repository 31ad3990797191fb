"""The frozen target model: loading, identity, and hidden-state capture at chosen layers.

    target = load_target(random_init={"model_type": "llama", ...}, tokenizer="recipes/pocket/target")
    hidden = target.hidden_states(input_ids, attention_mask, layers=[-1])  # (B, T, 1, d)

Hidden-state indices follow HF's `output_hidden_states` convention: 0 = embeddings (the input of
decoder layer 0), i = output of decoder layer i (the input of layer i, 0-based), -1 (or L) = the
output of the final norm, i.e. what lm_head reads. They are captured with hooks on the requested
layers only; the forward stops right after the last needed one and never computes the vocab
projection. Works for any HF causal LM whose base model exposes `embed_tokens`, `layers` and
`norm` (Llama, Qwen2, Mistral and most decoder-only families).

This module imports nothing of ours so it stays a pure model module.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from models.common import TargetParts

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Config keys that change with the transformers version or the loading call, not with the model.
_VOLATILE_CONFIG_KEYS = {
    "transformers_version",
    "_name_or_path",
    "name_or_path",
    "_model_name_or_path",  # a display name (GGUF conversions carry the file's `general.name`)
    "dtype",
    "torch_dtype",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "_attn_implementation_internal",
    "attn_implementation",
    "_commit_hash",
    "use_cache",
    "architectures",
}
# Elements of each parameter hashed into the weights fingerprint: cheap, yet tells fine-tunes apart.
_FINGERPRINT_ELEMENTS = 256


class TargetError(ValueError):
    """A target (or tokenizer) that cannot be loaded; the message names the recipe key and the path, on one line."""


def _why(exc: BaseException) -> str:
    """The first line of a loader's error (transformers' run over several lines)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _load_error(key: str, path: str, exc: BaseException) -> TargetError:
    if not Path(path).exists():
        return TargetError(f"{key}: no such directory {path}, and no model of that name could be fetched ({_why(exc)})")
    return TargetError(f"{key}: {path}: cannot be loaded ({_why(exc)})")


def tokenizer_identity(tokenizer) -> dict[str, str]:
    """sha256 of what decides a tokenizer's ids and a conversation's rendering: its vocabulary with the special tokens,
    and its chat template."""
    vocab = json.dumps(
        {"vocab": sorted(tokenizer.get_vocab().items()), "special": sorted(map(str, tokenizer.all_special_tokens))}
    ).encode()
    template = (tokenizer.chat_template or "").encode()
    return {
        "vocab_sha256": hashlib.sha256(vocab).hexdigest(),
        "chat_template_sha256": hashlib.sha256(template).hexdigest(),
    }


class _StopForward(Exception):
    """Raised by the last needed hook to skip the rest of the forward."""


@dataclass
class Target:
    """A frozen HF causal LM with what drafters and extraction need from it."""

    model: PreTrainedModel
    tokenizer: object | None
    name: str
    _whole: str | None = field(default=None, repr=False, compare=False)
    _offloaded_identity: dict | None = field(default=None, repr=False, compare=False)

    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def base(self) -> nn.Module:
        """The decoder stack without the vocab projection (`model.model` for Llama-like models)."""
        return self.model.base_model

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def num_layers(self) -> int:
        return len(self.base.layers)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def identity(self) -> dict:
        """What makes two targets produce the same features; recorded in feature manifests.

        `name` is informational (a moved directory is the same target); the other fields are compared.
        """
        if self.offloaded():  # weights left on disk or in host memory by a device_map: read them from the checkpoint
            if self._offloaded_identity is None:
                self._offloaded_identity = checkpoint_identity(self.name, str(self.dtype).removeprefix("torch."))
            return dict(self._offloaded_identity)
        tensors = self.model.state_dict().items()
        return _identity(self.name, self.config, self.num_layers, self.dtype, tensors, self.whole_weights_sha256())

    def offloaded(self) -> bool:
        """Whether a `device_map` left weights off every device ("cpu" beside GPUs, or "disk"): accelerate's hooks
        bring them in for each forward, and the model holds them on the meta device."""
        return any(p.device.type == "meta" for p in self.model.parameters())

    def whole_weights_sha256(self) -> str:
        """sha256 over every byte of every tensor, by name, in the loaded dtype (computed once: about 1 s per GB)."""
        if self._whole is None:
            self._whole = _whole_sha256(self.model.state_dict().items())
        return self._whole

    def parts(self, stored_layers: list[int]) -> TargetParts:
        """The frozen pieces a drafter borrows, with the hidden-state indices its batches carry."""
        for layer in stored_layers:
            hidden_index(layer, self.num_layers)
        return TargetParts(self.config, self.embed_tokens, self.lm_head, list(stored_layers), self.model)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        layers: list[int],
    ) -> torch.Tensor:
        """(B, T, len(layers), d) hidden states at HF indices `layers`, in that order.

        Index i < L is the input of decoder layer i (for i = 0 the embeddings, for i > 0 the output
        of layer i - 1, exactly what `output_hidden_states[i]` holds); index L or -1 is the output of
        the final norm. The forward raises out of the hook of the deepest requested index, so
        layers past it and lm_head never run.
        """
        wanted = [hidden_index(layer, self.num_layers) for layer in layers]
        deepest = max(wanted)
        L = self.num_layers
        captured: dict[int, torch.Tensor] = {}

        def grab(index: int, hidden: torch.Tensor) -> None:
            captured[index] = hidden
            if index == deepest:
                raise _StopForward

        handles = []
        for index in sorted(set(wanted)):
            if index < L:
                hook = lambda module, args, kwargs, i=index: grab(i, args[0] if args else kwargs["hidden_states"])
                handles.append(self.base.layers[index].register_forward_pre_hook(hook, with_kwargs=True))
            else:
                hook = lambda module, args, output: grab(L, output[0] if isinstance(output, tuple) else output)
                handles.append(self.base.norm.register_forward_hook(hook))
        try:
            self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        if len(wanted) == 1:  # EAGLE-1/2 and Medusa: a view, no copy
            return captured[wanted[0]].unsqueeze(2)  # (B, T, 1, d)
        home = captured[wanted[-1]].device  # a device_map target's layers sit on several GPUs: gather on one
        return torch.stack([captured[i].to(home) for i in wanted], dim=2)  # (B, T, n, d)


def hidden_index(layer: int, num_layers: int) -> int:
    """An HF hidden-state index of a `num_layers`-layer target, validated (ValueError), in 0..L (L or -1: after the
    final norm)."""
    if not -1 <= layer <= num_layers:
        raise ValueError(f"hidden-state index {layer} out of range for a {num_layers}-layer target (-1..{num_layers})")
    return num_layers if layer == -1 else layer


def _identity(name: str, config: PretrainedConfig, num_layers: int, dtype: torch.dtype, tensors, whole: str) -> dict:
    """`Target.identity()` from its parts; `tensors` iterates (name, tensor) in any order (a model's state dict, or a
    checkpoint read tensor by tensor)."""
    kept = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    config_blob = json.dumps(kept, sort_keys=True, default=str).encode()
    return {
        "name": name,
        "model_type": config.model_type,
        "num_layers": num_layers,
        "hidden_size": config.hidden_size,
        "dtype": str(dtype).removeprefix("torch."),
        "config_sha256": hashlib.sha256(config_blob).hexdigest(),
        "weights_sha256": _weights_fingerprint(tensors),
        "weights_sha256_whole": whole,
    }


def _weights_fingerprint(tensors) -> str:
    """sha256 over the first elements of every parameter: what identities recorded before whole tensors were hashed
    hold (`weights_sha256`), still compared with those."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        head = tensor.detach().reshape(-1)[:_FINGERPRINT_ELEMENTS].float().cpu()
        digest.update(name.encode())
        digest.update(head.numpy().tobytes())
    return digest.hexdigest()


def _whole_sha256(tensors) -> str:
    """sha256 over every byte of every (name, tensor), by name, in their dtype."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def checkpoint_identity(path: str, dtype: str = "bfloat16", trust_remote_code: bool = False) -> dict:
    """`load_target(path, dtype=dtype).identity()` without loading the model: the config builds the model's skeleton
    on the meta device (its state dict's names, tied weights included), and the checkpoint's safetensors are read one
    tensor at a time, cast to `dtype` as loading casts them. For a target served by an engine (vLLM): the features it
    extracts record the identity the transformers path records, in one tensor's memory."""
    from safetensors import safe_open

    if dtype not in DTYPES:
        raise ValueError(f"checkpoint_identity: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise _load_error("target.path", path, exc) from None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    _check_architecture(skeleton)
    index = Path(path) / "model.safetensors.index.json"  # what from_pretrained reads when the checkpoint is sharded
    if index.is_file():
        files = sorted({Path(path) / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(Path(path).glob("*.safetensors"))
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where |= dict.fromkeys(f.keys(), file)
    if not files:
        raise TargetError(f"target.path: {path}: no *.safetensors files (an engine-served target is read from them)")
    params = skeleton.state_dict(keep_vars=True)
    stored_as: dict[int, str] = {id(t): n for n, t in params.items() if n in where}  # a tied tensor's stored name
    missing = [n for n, t in params.items() if stored_as.get(id(t)) is None]
    if missing:
        raise TargetError(
            f"target.path: {path}: the safetensors hold no tensor {missing[0]!r} of the model "
            f"{type(skeleton).__name__} ({len(missing)} missing)"
        )

    handles = {file: safe_open(str(file), framework="pt") for file in files}

    def tensors():  # one at a time, in the loaded dtype
        for name, param in sorted(params.items()):
            stored = stored_as[id(param)]
            yield name, handles[where[stored]].get_tensor(stored).to(DTYPES[dtype])

    layers = len(skeleton.base_model.layers)
    return _identity(path, skeleton.config, layers, DTYPES[dtype], tensors(), _whole_sha256(tensors()))


def _check_architecture(model: PreTrainedModel) -> None:
    base = model.base_model
    children = dict(base.named_children())
    missing = [name for name in ("embed_tokens", "layers", "norm") if name not in children]
    if missing or model.get_output_embeddings() is None:
        raise ValueError(
            f"unsupported target architecture {type(model).__name__}: its base model "
            f"{type(base).__name__} lacks {missing or ['lm_head']} (need embed_tokens, layers, norm and an lm_head)"
        )


def load_target(
    path: str | None = None,
    random_init: dict | None = None,
    tokenizer: str | None = None,
    dtype: str = "bfloat16",
    seed: int = 0,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
    device_map: str | dict | None = None,
    max_memory: dict | None = None,
    offload_folder: str | None = None,
) -> Target:
    """Load an HF causal LM (from `path`, or randomly initialised from a config dict), frozen, in eval mode.

    Random weights are drawn in float32 under `seed` and then cast, so a bf16 target is the rounded
    float32 one. The tokenizer comes from `tokenizer` (default `path`); it is None when `path` has none.
    `device_map` / `max_memory` / `offload_folder` go to `from_pretrained` (a target spread over several GPUs, or
    partly offloaded to the host or a disk).
    """
    if (path is None) == (random_init is None):
        raise ValueError("load_target: pass exactly one of path and random_init")
    if device_map is not None and path is None:
        raise ValueError("load_target: device_map needs a path (random targets are built on one device)")
    if dtype not in DTYPES:
        raise ValueError(f"load_target: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if path is not None:
        placement = {} if device_map is None else {"device_map": device_map, "max_memory": max_memory,
                                                   "offload_folder": offload_folder}  # fmt: skip
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=DTYPES[dtype],
                trust_remote_code=trust_remote_code,
                attn_implementation=attn_implementation,
                **placement,
            )
        except (OSError, ValueError, SafetensorError) as exc:  # no such directory / model, truncated weights
            raise _load_error("target.path", path, exc) from None
        name = path
    else:
        fields = dict(random_init)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(
                config,
                dtype=torch.float32,
                trust_remote_code=trust_remote_code,
                attn_implementation=attn_implementation,
            )
        for param in model.parameters():  # not `.to(dtype)`: buffers (RoPE's inv_freq) stay float32, as
            param.data = param.data.to(DTYPES[dtype])  # from_pretrained keeps them
        name = f"random_init:{config.model_type}"
    _check_architecture(model)
    model.eval().requires_grad_(False)

    return Target(model=model, tokenizer=load_tokenizer(path, tokenizer, trust_remote_code), name=name)


def process_gpus(local_index: int, num_local_processes: int, num_gpus: int) -> list[int]:
    """The GPUs one process spreads a `device_map` target over: an equal, disjoint share of the node's.

    No GPUs (CPU runs) gives []; fewer GPUs than processes is an error (TargetError), since shares would overlap.
    """
    if num_gpus == 0:
        return []
    if num_gpus < num_local_processes:
        raise TargetError(
            f"target.device_map: {num_local_processes} processes on a node with {num_gpus} GPUs; "
            "launch at most one process per GPU (`accelerate launch --num_processes N`)"
        )
    share = num_gpus // num_local_processes
    return list(range(local_index * share, (local_index + 1) * share))


def load_placed_target(fields: dict, state) -> Target:
    """The target as process `state` of a run uses it (`fields`: `load_target`'s arguments, a recipe's `target`;
    `state`: accelerate's state of this process: its device, local index and process count).

    Without `device_map` it is loaded whole and moved to `device`. A named map (`auto`, `balanced`, `sequential`)
    spreads it over this process's equal share of the node's GPUs (`process_gpus`: N processes on a node never share
    one). An explicit map (module name -> a GPU index, "cpu", or "disk" with `offload_folder`) places it as it says;
    on a machine without GPUs, "cpu" and "disk" entries cut a target into pieces that accelerate's hooks run in turn
    (the "disk" ones' weights are read for each forward, never held)."""
    if fields.get("device_map") is None:
        target = load_target(**fields)
        target.model.to(state.device)
        return target
    if fields.get("max_memory") is None:
        fields = fields | {"max_memory": process_memory(fields["device_map"], state)}
    return load_target(**fields)


def process_memory(device_map: str | dict, state) -> dict | None:
    """`max_memory` for a named `device_map` on process `state`: its share of the node's GPUs (`process_gpus`);
    None for an explicit map or a machine without GPUs."""
    if not isinstance(device_map, str):
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))  # processes on this node
    gpus = process_gpus(state.local_process_index, local, count)
    return {g: torch.cuda.get_device_properties(g).total_memory for g in gpus} if gpus else None


def load_tokenizer(path: str | None, tokenizer: str | None = None, trust_remote_code: bool = False):
    """The target's tokenizer: from `tokenizer` (an error when it has none), else from `path` (None if it has none)."""
    tokenizer_dir = tokenizer or path
    if tokenizer_dir is None:
        return None
    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        if tokenizer is not None:  # asked for explicitly: its absence is an error
            raise _load_error("target.tokenizer", tokenizer, exc) from None
        return None
