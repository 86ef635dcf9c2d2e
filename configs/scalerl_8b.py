"""The full ScaleRL recipe: 8B dense policy, Polaris-53K, 48x16, PipelineRL-8, CISPO.

Set `--config.model.checkpoint=/path/to/hf_dir` and `--config.data.path=/path/to/polaris-data-53K.jsonl`.
"""

from scalerl_jax.config import recipes


def get_config():
    return recipes.scalerl_8b()
