"""SmolLM2-135M-Instruct (or any small Hugging Face instruct model) on the arithmetic ladder, on one CPU:

`python -m scalerl_jax.main --config=configs/smollm2_arith.py --config.model.checkpoint=DIR --workdir=runs/smollm2_arith`
"""

from scalerl_jax.config import recipes


def get_config():
    return recipes.smollm2_arith()
