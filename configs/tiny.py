"""The embedded default: a tiny policy, the synthetic arithmetic task, the ScaleRL recipe on one CPU.

`python -m scalerl_jax.main --config=configs/tiny.py --workdir=runs/tiny`
"""

from scalerl_jax.config import recipes


def get_config():
    return recipes.tiny()
