"""The ScaleRL recipe on the paper's 17Bx16 mixture-of-experts policy (Llama 4 Scout's text decoder),
laid out for the smallest H100 cluster (`configs/scalerl_scout.py`, 9 nodes of 8) or TPU v5p slice
(`configs/scalerl_scout.py:v5p`, 64 chips) it fits:
`python -m scalerl_jax.cli.compile_check --config=configs/scalerl_scout.py --target=h100:9x8`,
`python -m scalerl_jax.cli.compile_check --config=configs/scalerl_scout.py:v5p --target=v5p:4x4x4`.

Set `--config.model.checkpoint=/path/to/Llama-4-Scout-17B-16E` and `--config.data.path=/path/to/polaris-data-53K.jsonl`.
"""

from scalerl_jax.config import recipes


def get_config(target: str = "h100"):
    return recipes.scalerl_scout(target or "h100")
