"""Scale-up runs, e.g. `--config=configs/scale.py:bs2048`.

Variants: budget_32k, bs512, bs2048, gens8, gens24, gens32.
"""

from scalerl_jax.config import recipes


def get_config(variant: str):
    return recipes.scale(variant)
