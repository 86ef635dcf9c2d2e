"""The tiny run on math and code: arithmetic chains and code puzzles whose programs run in the
code sandbox (bubblewrap), half of each step's prompts from each, on one CPU:

`python -m scalerl_jax.main --config=configs/tiny_math_code.py --workdir=runs/tiny_math_code`
"""

from scalerl_jax.config import recipes


def get_config():
    return recipes.tiny_math_code()
