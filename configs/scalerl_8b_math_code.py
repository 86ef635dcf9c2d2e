"""The paper's math+code run: the ScaleRL 8B recipe with half of each step's prompts from a code
dataset, each domain with its own verifier, curves and fit:

`python -m scalerl_jax.main --config=configs/scalerl_8b_math_code.py --config.data.path=polaris-data-53K.jsonl --config.code.path=mbpp.jsonl --config.model.checkpoint=DIR`
"""

from scalerl_jax.config import recipes


def get_config():
    return recipes.scalerl_8b_math_code()
