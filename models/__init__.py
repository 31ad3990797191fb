"""Drafter modules. `DRAFTERS` maps a recipe's `drafter.method` to (config class, module class).

Adding a method = one file here, one entry below, recipes, one test file.
"""

from models.eagle import EagleConfig, EagleDrafter
from models.medusa import MedusaConfig, MedusaHeads
from models.medusa2 import Medusa2Config, Medusa2Model

DRAFTERS: dict[str, tuple[type, type]] = {
    "eagle2": (EagleConfig, EagleDrafter),
    "medusa1": (MedusaConfig, MedusaHeads),
    "medusa2": (Medusa2Config, Medusa2Model),
}
