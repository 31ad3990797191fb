"""Drafter methods and the frozen target.

`models.methods.METHODS` maps a recipe's `drafter.method` to its declaration (config, module, inputs, trees,
export formats, ...); `models.configs` holds the method configs without importing torch.
"""
