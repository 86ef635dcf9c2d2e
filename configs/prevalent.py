"""The prevalent recipes of the paper's Figure 2, e.g. `--config=configs/prevalent.py:minimax`.

Variants: deepseek_grpo, qwen25_dapo, magistral, minimax.
"""

from scalerl_jax.config import recipes


def get_config(variant: str):
    return recipes.prevalent(variant)
