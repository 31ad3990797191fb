"""Train a drafter.

    accelerate launch [--config_file recipes/accelerate/X.yaml] -m train RECIPE [key=value ...] [--resume]
    python -m train RECIPE [key=value ...] [--resume] [--stop-after N]

`--resume` continues from the newest checkpoint in `train.output_dir` (same as `train.resume=auto`;
`train.resume=DIR` picks one). `--stop-after N` saves a checkpoint after optimizer step N and exits,
as a pre-empted job would (the schedule still runs to `train.max_steps`).
"""

from __future__ import annotations

import argparse
import sys

from schema.recipe import RecipeError, check_inputs, load_recipe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--resume", action="store_true", help="resume from the newest checkpoint (train.resume=auto)")
    parser.add_argument("--stop-after", type=int, default=None, metavar="N", help="checkpoint after step N and exit")
    args = parser.parse_args(argv)
    overrides = list(args.overrides) + (["train.resume=auto"] if args.resume else [])
    if args.stop_after is not None and args.stop_after < 1:
        parser.error(f"--stop-after must be >= 1, got {args.stop_after}")
    try:
        recipe = load_recipe(args.recipe, overrides)
        online = ("data.train_files",) if recipe.train.online else ()  # offline runs read feature shards instead
        check_inputs(recipe, ("target.path", "target.tokenizer", "drafter", "train.output_dir", *online))
    except RecipeError as exc:
        sys.exit(f"error: {exc}")

    from data.chat import ChatTemplateError, DataError
    from models.common import DrafterInputError
    from models.target import TargetError
    from train.loop import TrainingError, train  # heavy imports only once the recipe is valid

    try:
        train(recipe, stop_after=args.stop_after)
    except (TrainingError, DataError, ChatTemplateError, TargetError, DrafterInputError) as exc:
        sys.exit(f"error: {exc}")
    finally:  # join the collectives' threads before the interpreter exits (a teardown abort otherwise, at times)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
