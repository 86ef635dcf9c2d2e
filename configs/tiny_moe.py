"""The embedded default on a mixture-of-experts policy: 8 experts per layer, 2 per token, on one CPU.

`python -m scalerl_jax.main --config=configs/tiny_moe.py --workdir=runs/tiny_moe`
"""

from scalerl_jax.config import recipes


def get_config():
    return recipes.tiny_moe()
