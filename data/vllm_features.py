"""Hidden states from vLLM for `data.extract --engine vllm`: the target runs in vLLM's offline engine.

    accelerate launch -m data.extract RECIPE --engine vllm [--engine-python P] [--engine-args JSON]

Each extraction process starts one vLLM worker (`data.engines`, in the Python that has vLLM) and hands it the
samples of each length batch as token ids; vLLM prefills them (one token generated and dropped) with hooks on its
model that record the states at the recipe's `data.layers` (HF indices: 0 the embeddings, i the output of decoder
layer i - 1, L or -1 the final norm's output); the worker writes them, float32, to a scratch file that this process
reads back. Everything else is extraction's own: the shard plan, the shards and their encodings, the manifest,
resuming, so the features are the transformers path's in every respect but the arithmetic that computed them
(`make check-vllm-extract` compares the two on a tiny float32 target, `benchmarks/extract_engines.py bench` on
SmolLM2).

The target never loads into this process: its identity (recorded in the manifest, and checked by training) is read
from its safetensors tensor by tensor (`models.target.checkpoint_identity`), the same identity the transformers path
records. The engine runs prompts whole (no chunked prefill, no prefix cache, eager: HIDDEN_ENGINE_ARGS), with
`max_model_len` one past the longest sample and `max_num_batched_tokens` the larger of that and
`data.extract_batch_tokens`; `--engine-args` may set other `vllm.LLM` arguments, e.g. `{"tensor_parallel_size": 8}`
(the states of tensor-parallel ranks are equal after their all-reduce: rank 0's are kept). On GPU nodes each
extraction process's engine gets tensor x pipeline parallel size of the node's GPUs.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.engines import EngineError, VllmEngine, engine_env, engine_python, vllm_dtype
from models.target import DTYPES, checkpoint_identity, hidden_index, load_tokenizer

SCRATCH_PREFIX = "specdraft-hidden-"


class VllmTarget:
    """What extraction asks of a target (identity, tokenizer, hidden size, `hidden_states`), computed by vLLM."""

    device = torch.device("cpu")

    def __init__(self, engine: VllmEngine, identity: dict[str, Any], tokenizer, dtype: str):
        self.engine, self._identity, self.tokenizer = engine, identity, tokenizer
        self.name, self.num_layers, self.hidden_size = identity["name"], identity["num_layers"], identity["hidden_size"]
        self.dtype = DTYPES[dtype]
        root = _scratch_root()
        _remove_stale_scratch(root)
        self._scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=root))

    def identity(self) -> dict[str, Any]:
        return dict(self._identity)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        layers: list[int],
    ) -> torch.Tensor:
        """(B, T, len(layers), d) as `models.target.Target.hidden_states` returns them for right-padded rows (padding
        positions hold zeros), in the target's dtype."""
        if position_ids is not None:
            raise ValueError("the vLLM target computes positions itself (position_ids must be None)")
        wanted = [hidden_index(layer, self.num_layers) for layer in layers]
        B, T = input_ids.shape
        lengths = [T] * B if attention_mask is None else attention_mask.sum(1).tolist()
        inputs = [input_ids[row, :length].tolist() for row, length in enumerate(lengths)]
        path = self._scratch / "hidden.f32"
        try:
            tokens = self.engine.hidden_states(inputs, wanted, path)
            flat = torch.from_numpy(np.fromfile(path, dtype=np.float32)).view(tokens, len(wanted), self.hidden_size)
        finally:
            path.unlink(missing_ok=True)
        out = torch.zeros(B, T, len(wanted), self.hidden_size, dtype=self.dtype)
        offset = 0
        for row, length in enumerate(lengths):
            out[row, :length] = flat[offset : offset + length]
            offset += length
        return out

    def close(self) -> None:
        self.engine.close()
        shutil.rmtree(self._scratch, ignore_errors=True)


def _scratch_root() -> str:
    """Memory-backed /dev/shm when there is one (the states cross once, never touching a disk), else the default."""
    return "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()


def _remove_stale_scratch(root: str) -> None:
    """Scratch directories of extraction processes that are gone (killed before they could remove theirs: in
    /dev/shm they would hold memory until a reboot)."""
    for path in Path(root).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = path.name.removeprefix(SCRATCH_PREFIX).split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def check_vllm_target(target):
    """The tokenizer of recipe section `target`, once its settings are ones vLLM can run (else EngineError naming the
    key)."""
    if target.path is None:
        raise EngineError("target.path: --engine vllm runs a target directory (target.random_init is for --engine hf)")
    if target.device_map is not None:
        raise EngineError("target.device_map: is for --engine hf; vLLM places the model itself (see --engine-args)")
    return load_tokenizer(target.path, target.tokenizer, target.trust_remote_code)


def load_vllm_target(target, tokenizer, state, *, python: str | None, engine_args: dict[str, Any], log: Path,
                     longest: int, batch_tokens: int) -> VllmTarget:  # fmt: skip
    """This extraction process's vLLM target for recipe section `target` (`target.path`, checked by
    `check_vllm_target`), its worker's stderr in `log`; `longest` is the longest sample's token count. Raises
    EngineError (one line)."""
    check_vllm_target(target)
    dtype = vllm_dtype(target.path, target.dtype)
    identity = checkpoint_identity(target.path, dtype, target.trust_remote_code)
    python = engine_python(python)
    hidden = {"max_model_len": longest + 1, "max_num_batched_tokens": max(longest + 1, batch_tokens)}
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"vLLM engine: {python} loads {target.path} (its log: {log})", file=sys.stderr, flush=True)
    engine = VllmEngine(
        python,
        target.path,
        dtype,
        log,
        trust_remote_code=target.trust_remote_code,
        engine_args=engine_args,
        env=engine_env(engine_args, state, cuda),
        hidden=hidden,
    )
    return VllmTarget(engine, identity, tokenizer, dtype)


def start_for_recipe(recipe, state, engine: dict[str, Any], tokenizer, samples: list) -> VllmTarget:
    """The vLLM target of extraction process `state` for `recipe` (`engine`: {"python", "engine_args"}), its
    worker's log `vllm<rank>.log` in the features directory, sized for the longest of `samples`."""
    return load_vllm_target(
        recipe.target,
        tokenizer,
        state,
        python=engine["python"],
        engine_args=engine["engine_args"],
        log=Path(recipe.data.features_dir) / f"vllm{state.process_index}.log",
        longest=max((len(s["input_ids"]) for s in samples), default=1),
        batch_tokens=recipe.data.extract_batch_tokens,
    )
