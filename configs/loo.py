"""Leave-one-out runs: ScaleRL with one choice reverted, e.g. `--config=configs/loo.py:dapo`.

Variants: dapo, no_fp32_head, sample_avg, token_avg, prompt_norm, no_zero_variance_filter,
no_positive_resampling, length_penalty, ppo_off_policy.
"""

from scalerl_jax.config import recipes


def get_config(variant: str):
    return recipes.leave_one_out(variant)
