"""The recipe schema, the one package every stage imports: YAML -> typed, validated sections, with no torch.

    from schema.recipe import load_recipe, RecipeError
    recipe = load_recipe("recipes/tiny/eagle2.yaml", overrides=["train.lr=1e-3"])

Files: `recipe.py` (the whole recipe and its cross-section checks), `sections.py` and `evaluation.py` (the sections,
the size bounds), `parse.py` (bounded YAML reading, `key=value` overrides). It imports the drafters' declarations
(`methods`: the entries and their configs, no torch) and the run directories' checks (`rundir`), nothing else of ours.
"""
