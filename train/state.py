"""The training state, full and keyed by parameter name, whatever the backend: what a checkpoint holds.

    params, moments, groups = gather_state(accelerator, model, optimizer)     # collective
    restore_state(accelerator, model, optimizer, params, moments, groups)    # collective

`params` maps each trainable parameter name (as the unwrapped drafter names it) to its full fp32
value, `moments` maps "<name>/<key>" to the full AdamW state (`exp_avg`, `exp_avg_sq`, `step`), and
`groups` holds each parameter group's hyper-parameters and parameter names (plain JSON). Nothing
in it depends on the number of processes or on how they shard the state, so a run saved by 8
processes resumes on 4, and no file is ever a pickle.

Backends:
- one process, DDP: the module's parameters and the torch optimizer's state, read directly;
- FSDP: torch.distributed.checkpoint's full state dicts (the same names);
- DeepSpeed ZeRO-1/2/3: the fp32 master weights and moments through DeepSpeed's per-parameter
  fragment API (`safe_get_full_fp32_param`, `safe_get_full_optimizer_state`), so that neither
  DeepSpeed's own checkpoint files (pickles) nor its world-size-bound layout are involved.

RNG states are per process (`rng_state` / `set_rng_state`) and JSON too.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer accelerate's wrapper steps (DeepSpeed's ZeRO optimizer under DeepSpeed), or a bare one."""
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def _trainable(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in accelerator.unwrap_model(model).named_parameters() if p.requires_grad}


def _hyper(group: dict) -> dict:
    """A parameter group's hyper-parameters as JSON values (betas: a list), without its parameters."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k != "params"}


def _group_meta(groups: list[dict], names: dict[int, str]) -> list[dict]:
    """Hyper-parameters of each group (JSON types) and the names of its parameters."""
    return [{**_hyper(group), "params": [names[id(p)] for p in group["params"]]} for group in groups]


# --------------------------------------------------------------------------------------------
# Gather (save)


def gather_state(
    accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict]]:
    """(params, moments, groups), full on the main process (other processes may get partial or empty dicts)."""
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return _gather_deepspeed(accelerator, model, optimizer)
    if kind == DistributedType.FSDP:
        return _gather_fsdp(accelerator, model, optimizer)
    trainable = _trainable(accelerator, model)
    inner = _torch_optimizer(optimizer)
    params = {n: p.detach().float().cpu() for n, p in trainable.items()}
    moments = {}
    for name, p in trainable.items():
        for key, value in inner.state.get(p, {}).items():
            moments[f"{name}/{key}"] = value.detach().float().cpu().reshape(value.shape)
    names = {id(p): n for n, p in trainable.items()}
    return params, moments, _group_meta(inner.param_groups, names)


def _gather_fsdp(accelerator, model, optimizer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    inner = _torch_optimizer(optimizer)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, inner, options=options)
    trainable = _trainable(accelerator, model)
    params = {n: model_sd[n].float() for n in trainable if n in model_sd}
    # with cpu_offload only rank 0 receives the full dicts; the others get empty ones
    states, param_groups = optim_sd.get("state", {}), optim_sd.get("param_groups", [])
    moments = {f"{n}/{k}": v.float() for n, state in states.items() for k, v in state.items()}
    groups = [{**_hyper(g), "params": g["params"]} for g in param_groups]  # params: names already
    return params, moments, groups


def _zero_optimizer(engine_optimizer) -> tuple[Any, int]:
    """DeepSpeed's ZeRO optimizer inside accelerate's wrapper, and its stage: 2 for ZeRO-1/2 (one class), or 3."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    zero = _torch_optimizer(engine_optimizer)
    if isinstance(zero, DeepSpeedZeroOptimizer):
        return zero, 2
    if isinstance(zero, DeepSpeedZeroOptimizer_Stage3):
        return zero, 3
    raise TypeError(
        f"DeepSpeed optimizer {type(zero).__name__}: checkpoints are written through ZeRO's per-parameter API, so "
        "training under DeepSpeed needs zero_optimization.stage 1, 2 or 3 in the accelerate config"
    )


def _base_optimizer(engine_optimizer) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed's ZeRO optimizer steps (over flat fp32 partitions)."""
    return _zero_optimizer(engine_optimizer)[0].optimizer


def _link_moments(engine_optimizer, step: float | None = None) -> None:
    """Make every parameter's fragment view see the AdamW moments of its flat partition.

    ZeRO-1/2 link the views once, after the first group's first step, so groups stepped later have none
    (and `safe_get_full_optimizer_state` fails on them); before any step (resume) there are no moments at
    all. With `step`, missing moments are created (zeros, to be overwritten) with that step count."""
    zero, stage = _zero_optimizer(engine_optimizer)
    base = zero.optimizer
    flats = zero.single_partition_of_fp32_groups if stage == 2 else zero.fp32_partitioned_groups_flat
    if step is not None:
        for flat in flats:
            if not base.state[flat]:
                base.state[flat].update(
                    step=torch.tensor(step), exp_avg=torch.zeros_like(flat), exp_avg_sq=torch.zeros_like(flat)
                )
    if stage == 2:  # ZeRO-3 reads the state directly
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def _gather_deepspeed(accelerator, model, optimizer):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    trainable = _trainable(accelerator, model)
    main = accelerator.is_main_process
    _link_moments(optimizer)
    params, moments = {}, {}
    for name, p in trainable.items():  # collective under ZeRO-3: every process walks the same names
        full = safe_get_full_fp32_param(p)
        states = {key: safe_get_full_optimizer_state(p, key) for key in MOMENT_KEYS}
        if main:
            params[name] = full.detach().float().cpu()
            for key, value in states.items():
                if value is not None:
                    moments[f"{name}/{key}"] = value.detach().float().cpu()
    step = None
    for state in _base_optimizer(optimizer).state.values():
        if "step" in state:
            step = float(state["step"])
            break
    if step is not None and main:
        for name in trainable:
            moments[f"{name}/step"] = torch.tensor(step)
    names = {id(p): n for n, p in trainable.items()}
    groups = _deepspeed_groups(optimizer, trainable, names)
    return params, moments, groups


def _deepspeed_groups(optimizer, trainable, names) -> list[dict]:
    """Group hyper-parameters from the base optimizer; parameter names from the groups the loop built.

    DeepSpeed keeps the loop's group dicts (replacing their params by flat partitions), in order."""
    zero, stage = _zero_optimizer(optimizer)
    original = zero.bit16_groups if stage == 2 else zero.fp16_groups
    out = []
    for i, group in enumerate(zero.optimizer.param_groups):
        meta = _hyper(group)
        if i < len(original):
            meta["params"] = [names[id(p)] for p in original[i] if id(p) in names]
        out.append(meta)
    return out


# --------------------------------------------------------------------------------------------
# Restore (resume)


def restore_state(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    params: dict[str, torch.Tensor],
    moments: dict[str, torch.Tensor],
    groups: list[dict],
) -> None:
    """Load what `gather_state` returned into a freshly prepared model and optimizer (collective).

    Raises ValueError naming the first parameter or group that does not match."""
    trainable = _trainable(accelerator, model)
    missing, extra = sorted(trainable.keys() - params.keys()), sorted(params.keys() - trainable.keys())
    if missing or extra:
        raise ValueError(f"parameters do not match the drafter: missing {missing[:3]}, unexpected {extra[:3]}")
    kind = accelerator.distributed_type
    zero3 = kind == DistributedType.DEEPSPEED and _zero_optimizer(optimizer)[1] == 3
    for name, p in trainable.items():
        shape = tuple(p.ds_shape if zero3 else p.shape)  # ZeRO-3 partitions a parameter; ds_shape is its own
        if tuple(params[name].shape) != shape:
            raise ValueError(f"parameter {name}: saved shape {tuple(params[name].shape)}, drafter has {shape}")
    if kind == DistributedType.DEEPSPEED:
        _restore_deepspeed(optimizer, trainable, params, moments, groups)
    elif kind == DistributedType.FSDP:
        _restore_fsdp(model, optimizer, params, moments, groups)
    else:
        _restore_plain(optimizer, trainable, params, moments, groups)


def _apply_groups(param_groups: list[dict], groups: list[dict]) -> None:
    if len(param_groups) != len(groups):
        raise ValueError(f"{len(groups)} optimizer parameter groups saved, the optimizer has {len(param_groups)}")
    for group, saved in zip(param_groups, groups):
        for key, value in saved.items():
            if key != "params":
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value


def _restore_plain(optimizer, trainable, params, moments, groups) -> None:
    inner = _torch_optimizer(optimizer)
    names = {id(p): n for n, p in trainable.items()}
    for group, saved in zip(inner.param_groups, groups):
        now = [names[id(p)] for p in group["params"]]
        if "params" in saved and saved["params"] != now:
            raise ValueError(f"optimizer group holds {now[:3]}..., saved {saved['params'][:3]}...")
    _apply_groups(inner.param_groups, groups)
    with torch.no_grad():
        for name, p in trainable.items():
            p.copy_(params[name].to(p.dtype))
            state = {k.split("/", 1)[1]: v for k, v in moments.items() if k.split("/", 1)[0] == name}
            if state:
                inner.state[p] = {
                    k: v.to(p.device, p.dtype if k != "step" else torch.float32) for k, v in state.items()
                }


def _restore_fsdp(model, optimizer, params, moments, groups) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    inner = _torch_optimizer(optimizer)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in moments.items():
        name, sub = key.split("/", 1)
        state.setdefault(name, {})[sub] = value
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_state_dict(
        model,
        inner,
        model_state_dict=params,
        optim_state_dict={"state": state, "param_groups": groups},
        options=options,
    )


def _restore_deepspeed(optimizer, trainable, params, moments, groups) -> None:
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    base = _base_optimizer(optimizer)
    _apply_groups(base.param_groups, groups)
    steps = {float(v) for k, v in moments.items() if k.endswith("/step")}
    if len(steps) > 1:
        raise ValueError(f"parameters saved at different AdamW steps {sorted(steps)}; DeepSpeed keeps one per group")
    _link_moments(optimizer, steps.pop() if steps else 0.0)
    for name, p in trainable.items():
        safe_set_full_fp32_param(p, params[name].to(p.device))
        for key in MOMENT_KEYS:
            if f"{name}/{key}" in moments:
                safe_set_full_optimizer_state(p, moments[f"{name}/{key}"].to(p.device), key)
        # the 16-bit (or working) copy the forward pass uses: ZeRO-3 gathers it to write it
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            p.copy_(params[name].to(p.device, p.dtype))


# --------------------------------------------------------------------------------------------
# RNG


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON values."""
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
