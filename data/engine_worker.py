"""The vLLM worker: run by the Python that has vLLM (`PYTHON data/engine_worker.py`), driven by `data.engines`.

It imports nothing but the standard library and vllm (torch, vLLM's own, only inside the requests), builds
`vllm.LLM` once and answers requests of token ids over its stdin / stdout, one JSON object a line (it moves its
stdout aside first: whatever vLLM prints goes to stderr, which the driver sends to a log file):

    -> {"load": {"model": DIR, "dtype": "float32", "trust_remote_code": false, "engine_args": {...},
                 "hidden": {"max_model_len": N, "max_num_batched_tokens": M}}}      ("hidden": only to extract)
    <- {"ready": {"vllm": VERSION, "platform": "cpu", "max_model_len": N}}
    -> {"generate": {"inputs": [[id, ...], ...], "seeds": [...], "max_tokens": N, "temperature": T, "top_p": P,
                     "stop_token_ids": [...]}}
    <- {"outputs": [[id, ...], ...]}        (per input, in order; the stop token last when it stopped)
    -> {"hidden": {"inputs": [[id, ...], ...], "layers": [i, ...], "path": FILE}}
    <- {"tokens": T}                        (FILE holds float32 (T, len(layers), hidden size): inputs in order)

and `{"error": "one line"}` in place of any answer (the worker then exits). End of input ends the worker, and so does
the death of the process that started it.

Generation: the engine is built with `skip_tokenizer_init=True` (the inputs are ids; the stop tokens are the
driver's) and `generation_config="vllm"` (the target's sampling defaults stay out, as in the HF engine); greedy
requests use temperature 0, sampled ones `SamplingParams(seed=...)`, vLLM's per-request generator, so a record's
sample does not depend on what else is in the batch. Hidden states: an engine loaded with "hidden" computes every
prompt token (no prefix cache) with each prompt in one forward (no chunked prefill), eagerly; hooks on its model
record each forward's token ids, positions and the states at the HF indices asked (0 the embeddings, i the output of
decoder layer i - 1, which vLLM returns as hidden + residual, L the final norm's output); prompts are cut where the
positions restart at 0 and matched to the inputs by their token ids. On vLLM's CPU platform the worker sets what
`benchmarks/vllm_serve.py` sets unless the environment does (no thread binding, the engine in this process, a KV
cache of 2 GiB) and runs eagerly; `engine_args` go to `vllm.LLM` as they are.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
CPU_ENV = {  # vLLM's CPU platform, as benchmarks/vllm_serve.py runs it; the environment's own values win
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


class EngineError(RuntimeError):
    """What went wrong in or with the engine, in one line."""


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message` (vLLM's and pydantic's errors run over many lines)."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _watch_parent() -> None:
    """Exit when the process that started this one is gone (its stdin stays open while a grandchild holds it)."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _build(load: dict[str, Any]):
    try:
        import vllm
        from vllm import LLM
    except Exception as exc:  # noqa: BLE001 - any import failure means "no usable vLLM here"
        raise EngineError(
            f"no vLLM in {sys.executable} ({one_line(exc)}); `make vllm-env` builds .venv-vllm with vLLM's CPU build, "
            "or name a Python that has vLLM with --engine-python"
        ) from None
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    if cpu:
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
    engine = {"enforce_eager": True} if cpu else {}
    engine |= load.get("engine_args") or {}
    if load.get("hidden") is not None:  # prefill only: every prompt token computed, each prompt in one forward
        engine = dict(load["hidden"]) | engine  # max_model_len, max_num_batched_tokens: the driver's defaults
        engine |= {"enable_prefix_caching": False, "enable_chunked_prefill": False, "enforce_eager": True}
    engine |= {
        "model": load["model"],
        "dtype": load["dtype"],
        "seed": 0,
        "trust_remote_code": bool(load.get("trust_remote_code")),
        "skip_tokenizer_init": True,
        "generation_config": "vllm",
    }
    try:
        llm = LLM(**engine)
    except Exception as exc:  # noqa: BLE001
        raise EngineError(
            f"vLLM {vllm.__version__} could not build its engine for {load['model']}: {one_line(exc)}"
        ) from None
    info = {
        "vllm": vllm.__version__,
        "platform": current_platform.device_type,
        "max_model_len": llm.llm_engine.model_config.max_model_len,
    }
    return llm, info


def _generate(llm, request: dict[str, Any]) -> list[list[int]]:
    from vllm import SamplingParams

    greedy = request["temperature"] == 0
    params = [
        SamplingParams(
            n=1,
            max_tokens=request["max_tokens"],
            temperature=request["temperature"],
            top_p=1.0 if greedy else request["top_p"],
            seed=None if greedy else seed,
            stop_token_ids=request["stop_token_ids"],
            detokenize=False,
        )
        for seed in request["seeds"]
    ]
    prompts = [{"prompt_token_ids": ids} for ids in request["inputs"]]
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    except Exception as exc:  # noqa: BLE001
        raise EngineError(f"vLLM's generate failed: {one_line(exc)}") from None
    return [list(out.outputs[0].token_ids) for out in outs]


def _install_capture(worker, layers: list[int]) -> int:
    """Hooks on this vLLM worker's model that record, for every forward, the token ids, their positions and the
    hidden states at HF indices `layers`: 0 the input of decoder layer 0, i < L the output of layer i - 1 (vLLM's
    layers return (hidden, residual), whose sum is the layer's output), L the final norm's output. Runs on every
    worker through `LLM.collective_rpc`; returns the number of layers."""
    import torch

    stack = worker.model_runner.model.model
    L = len(stack.layers)
    if not all(0 <= index <= L for index in layers):
        raise ValueError(f"hidden-state indices {layers} out of range for a {L}-layer target (0..{L})")
    steps: list[dict] = []
    handles = []

    def keep(index: int, tensor) -> None:
        steps[-1][index] = tensor.detach().to("cpu", torch.float32, copy=True)

    def first(module, args, kwargs) -> None:  # decoder layer 0's inputs: positions, hidden_states, residual
        positions = args[0] if args else kwargs["positions"]
        steps[-1]["positions"] = positions.detach().to("cpu", copy=True)
        if 0 in layers:
            keep(0, args[1] if len(args) > 1 else kwargs["hidden_states"])

    def ids(module, args, output) -> None:
        steps.append({"ids": args[0].detach().to("cpu", copy=True)})

    def after(index: int):
        def hook(module, args, output) -> None:
            hidden, residual = output if isinstance(output, tuple) else (output, None)
            keep(index, hidden if residual is None else hidden + residual)

        return hook

    def normed(module, args, output) -> None:
        keep(L, output[0] if isinstance(output, tuple) else output)

    handles.append(stack.embed_tokens.register_forward_hook(ids))
    handles.append(stack.layers[0].register_forward_pre_hook(first, with_kwargs=True))
    for index in sorted(set(layers) - {0, L}):
        handles.append(stack.layers[index - 1].register_forward_hook(after(index)))
    if L in layers:
        handles.append(stack.norm.register_forward_hook(normed))
    worker._specdraft_capture = (steps, handles)
    return L


def _take_capture(worker) -> list[dict]:
    """The forwards `_install_capture` recorded on this worker; its hooks are removed."""
    steps, handles = worker._specdraft_capture
    for handle in handles:
        handle.remove()
    del worker._specdraft_capture
    return steps


def _hidden(llm, request: dict[str, Any]) -> int:
    """Prefill every input (one token generated, then dropped) with the capture hooks on; write the float32 hidden
    states of every input's tokens, inputs in order, to request["path"]; return the token count. Each captured
    forward holds whole prompts (no chunked prefill, no prefix cache); a prompt starts where the positions restart
    at 0, and is matched to its input by its token ids."""
    from vllm import SamplingParams

    inputs, layers = request["inputs"], request["layers"]
    try:
        llm.collective_rpc(_install_capture, args=(layers,))
    except Exception as exc:  # noqa: BLE001
        raise EngineError(f"vLLM's model cannot be hooked for hidden states: {one_line(exc)}") from None
    try:
        params = SamplingParams(n=1, max_tokens=1, temperature=0.0, detokenize=False)
        llm.generate([{"prompt_token_ids": ids} for ids in inputs], params, use_tqdm=False)
    except Exception as exc:  # noqa: BLE001
        raise EngineError(f"vLLM's generate failed: {one_line(exc)}") from None
    finally:
        steps = llm.collective_rpc(_take_capture)[0]  # tensor-parallel ranks hold the same states: rank 0's
    found = _assemble(steps, inputs, layers)
    with open(request["path"], "wb") as f:
        for h in found:
            f.write(h.numpy().tobytes())
    return sum(len(h) for h in found)


def _assemble(steps: list[dict], inputs: list[list[int]], layers: list[int]) -> list[Any]:
    """Per input, in order, the (tokens, len(layers), d) states of the captured forwards `steps` (each {"ids",
    "positions", index: (tokens, d)}): a prompt starts where the positions restart at 0 and is matched to an input
    with its token ids (equal inputs get equal states). EngineError for a sequence that is no whole input."""
    import collections

    import torch

    pending: dict[tuple[int, ...], collections.deque] = collections.defaultdict(collections.deque)
    for i, ids in enumerate(inputs):
        pending[tuple(ids)].append(i)
    found: list[Any] = [None] * len(inputs)
    for step in steps:
        positions = step["positions"].tolist()
        starts = [t for t, position in enumerate(positions) if position == 0] + [len(positions)]
        if starts[0] != 0:
            raise EngineError("vLLM ran a forward that starts inside a prompt (a chunked or cached prompt?)")
        hidden = torch.stack([step[index] for index in layers], dim=1)  # (tokens, n, d)
        for start, end in zip(starts, starts[1:]):
            key = tuple(step["ids"][start:end].tolist())
            if not pending.get(key) or positions[start:end] != list(range(end - start)):
                raise EngineError(
                    f"vLLM ran a sequence of {end - start} tokens that is no whole input (a chunked or cached prompt?)"
                )
            found[pending[key].popleft()] = hidden[start:end]
    if any(h is None for h in found):
        raise EngineError(f"vLLM ran {sum(h is None for h in found)} of the {len(inputs)} inputs out of sight")
    return found


def worker() -> None:
    # This file's folder (data/, the first entry of sys.path) must not shadow what vLLM imports.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE.parent]
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")  # the protocol's channel
    os.dup2(2, 1)  # anything printed (by vLLM or anyone) goes to the log
    threading.Thread(target=_watch_parent, daemon=True).start()

    def answer(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    llm = None
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            if "load" in request:
                llm, info = _build(request["load"])
                answer({"ready": info})
            elif "generate" in request and llm is not None:
                answer({"outputs": _generate(llm, request["generate"])})
            elif "hidden" in request and llm is not None:
                answer({"tokens": _hidden(llm, request["hidden"])})
            else:
                raise EngineError(f"unexpected request {line[:80]!r}")
    except EngineError as exc:
        answer({"error": str(exc)})
        sys.exit(1)
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the driver gets one line
        import traceback

        traceback.print_exc()
        answer({"error": f"the vLLM worker failed: {one_line(exc)}"})
        sys.exit(1)


if __name__ == "__main__":
    worker()
