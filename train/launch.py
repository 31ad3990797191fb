"""What a training run is launched into: the accelerator a recipe and `accelerate launch` ask for (one process, DDP,
FSDP or DeepSpeed, checked to be what was asked) and its tracker (wandb keeps its run across resumptions).
`train.loop` uses them."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, parse_flag_from_env

from schema.recipe import Recipe
from train import TrainingError


def make_accelerator(recipe: Recipe) -> Accelerator:
    cfg, tracker = recipe.train, recipe.logging.tracker
    if tracker == "wandb" and not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    # Several processes without CUDA: torch.distributed needs gloo (accelerate picks nccl under DeepSpeed).
    cpu_distributed = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = [InitProcessGroupKwargs(backend="gloo")] if cpu_distributed else []
    cpu_fsdp = (
        cpu_distributed and parse_flag_from_env("ACCELERATE_USE_FSDP") and not parse_flag_from_env("ACCELERATE_USE_CPU")
    )
    if cpu_distributed and parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        _plain_deepspeed_collectives()
    accelerator = Accelerator(
        cpu=cpu_fsdp,
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.grad_accum,
        log_with=None if tracker == "none" else tracker,
        project_dir=cfg.output_dir,
        kwargs_handlers=handlers,
    )
    if cpu_fsdp:
        _fsdp_on_cpu(accelerator)
    _check_backend(accelerator)
    if accelerator.num_processes > 1 and accelerator.distributed_type == DistributedType.NO:
        raise TrainingError(
            f"{accelerator.num_processes} processes but accelerate set up no distributed backend "
            "(on CPU: ACCELERATE_USE_CPU=true accelerate launch --multi_gpu ... for DDP, or --config_file "
            "recipes/accelerate/fsdp.yaml without ACCELERATE_USE_CPU for FSDP)"
        )
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:  # DeepSpeed owns batch size, accumulation and clipping: give it the recipe's
        ds = plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.batch_size
        ds["gradient_accumulation_steps"] = cfg.grad_accum
        ds["gradient_clipping"] = cfg.clip_grad_norm or 0.0
        # ZeRO-3: checkpoints gather the full drafter tensors (drafter.safetensors, read by export.write)
        ds.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    return accelerator


def _plain_deepspeed_collectives() -> None:
    """DeepSpeed on CPU processes (a rehearsal of a GPU launch) with torch.distributed's gloo collectives. Otherwise its
    first launch compiles a C++ shared-memory all-reduce (minutes on a small machine), under a lock file that a build
    killed midway leaves behind for every later launch to wait on forever."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _fsdp_on_cpu(accelerator: Accelerator) -> None:
    """FSDP2 on CPU processes (gloo). torch shards on CPU, but accelerate turns FSDP on only for accelerator devices
    (its AcceleratorState sets up plain MULTI_CPU instead); after the gloo group is up, switch its state to FSDP
    with the plugin the launch configured (FSDP_* environment variables), as it would on GPUs."""
    from accelerate.state import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # re-read by every later PartialState()


def _check_backend(accelerator: Accelerator) -> None:
    """The launch asked for DeepSpeed or FSDP: refuse to train as anything else. With ACCELERATE_USE_CPU=true
    accelerate quietly sets up plain CPU data parallel instead (every process holding everything)."""
    asked = [name for name, var in (("DeepSpeed", "ACCELERATE_USE_DEEPSPEED"), ("FSDP", "ACCELERATE_USE_FSDP"))
             if parse_flag_from_env(var)]  # fmt: skip
    wanted = {"DeepSpeed": DistributedType.DEEPSPEED, "FSDP": DistributedType.FSDP}
    if asked and accelerator.distributed_type != wanted[asked[0]]:
        raise TrainingError(
            f"the launch asked for {asked[0]} but accelerate set up {accelerator.distributed_type.value} (plain data "
            "parallel: ACCELERATE_USE_CPU=true does that); "
            + (
                "for ZeRO on CPU launch without ACCELERATE_USE_CPU: accelerate launch --config_file "
                "recipes/accelerate/zero2.yaml --num_processes 2 -m train RECIPE"
                if asked[0] == "DeepSpeed"
                else "for FSDP on CPU launch without ACCELERATE_USE_CPU: accelerate launch --config_file "
                "recipes/accelerate/fsdp.yaml --num_processes 2 -m train RECIPE"
            )
        )


def _flat(d: dict, prefix: str = "") -> dict:
    """Flat scalar config for trackers (tensorboard hparams take scalars and strings only)."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


WANDB_ID_FILE = "wandb_run_id"


def tracker_kwargs(recipe: Recipe, accelerator: Accelerator) -> dict:
    """wandb keeps its files under the run directory, and a resumed run continues the same wandb run (its id
    is kept in `<output_dir>/wandb_run_id`)."""
    if recipe.logging.tracker != "wandb":
        return {}
    out_dir = Path(recipe.train.output_dir)
    id_file = out_dir / WANDB_ID_FILE
    if accelerator.is_main_process and not id_file.is_file():
        id_file.write_text(uuid.uuid4().hex[:12] + "\n")
    accelerator.wait_for_everyone()
    kwargs = {"dir": str(out_dir), "id": id_file.read_text().strip(), "resume": "allow"}
    if recipe.logging.run_name:
        kwargs["name"] = recipe.logging.run_name
    return {"wandb": kwargs}


def tracker_config(recipe: Recipe) -> dict:
    """The recipe as the tracker's run config: flat `section.key` scalars."""
    return _flat(recipe.to_dict())
