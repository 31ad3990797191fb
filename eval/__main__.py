"""Acceptance-length evaluation: speculative decoding against plain decoding and prompt lookup, same prompts, same run.

    python -m eval RECIPE [key=value ...]
    accelerate launch -m eval RECIPE [key=value ...]

Runs `eval.run.run` on the recipe (what is decoded and reported: see `eval/run.py`), prints one summary line, and
reports bad input as one `error: ...` line with a non-zero exit. Without a GPU the Triton kernels
(`eval.kernels: triton`) run under the Triton interpreter, switched on here before triton is imported.
"""

from __future__ import annotations

import argparse
import os
import sys


def use_interpreter_without_gpu(say: bool = True) -> None:
    """Without a GPU, run the Triton kernels under the Triton interpreter (TRITON_INTERPRET=1): slow, but the same
    kernels. Must run before `eval.kernels` (or triton) is imported: the interpreter is chosen when kernels are
    defined. The report names what ran them (`kernels_backend`); `say`: print it too (not when the recipe runs the
    PyTorch twins instead)."""
    import torch  # importing torch does not import triton

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        if say:
            print("eval: no GPU: the Triton kernels run under the Triton interpreter (TRITON_INTERPRET=1)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="YAML recipe (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parser.parse_args(argv)
    from schema.recipe import RecipeError, load_recipe  # imports neither torch nor triton

    try:
        recipe = load_recipe(args.recipe, args.overrides, inputs=("target.path", "target.tokenizer", "eval.prompts"))
    except RecipeError as exc:
        sys.exit(f"error: {exc}")
    use_interpreter_without_gpu(say=recipe.eval.kernels == "triton")
    from eval.run import INPUT_ERRORS, output_dir, run, summary_line

    try:
        summary = run(recipe)
    except INPUT_ERRORS as exc:
        sys.exit(f"error: {exc}")
    finally:  # under `accelerate launch`: a process that exits with its process group alive can abort at shutdown
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if summary is not None:
        print(summary_line(summary, output_dir(recipe)))


if __name__ == "__main__":
    main()
