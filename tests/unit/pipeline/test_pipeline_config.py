"""`config.adapters.pipeline_config_of`: the pipeline of a run config, fresh and resumed, checked field by
field against the recipe's numbers (`recipes.scalerl_8b`: Polaris prompts of 2,048 tokens, 14,336
completion tokens, 48 x 16, PipelineRL-8, forced interruption, 10,000 steps)."""

import pytest

from scalerl_jax.config import recipes
from scalerl_jax.config.adapters import pipeline_config_of
from scalerl_jax.pipeline.config import PipelineConfig


def flops(rows, length):
    return 2.0 * rows * length


def test_the_8b_recipe_resumed_at_step_4096():
    config = pipeline_config_of(
        recipes.scalerl_8b(), stop_tokens=[7, 8], start_step=4096, train_step_flops=flops, peak_flops_per_s=1e15
    )
    assert config == PipelineConfig(
        max_new_tokens=14336,
        max_seq_len=2048 + 14336,
        schedule="pipeline",
        k=8,
        prompts_per_step=48,
        samples_per_prompt=16,
        num_steps=10000 - 4096,
        capacity=None,  # queue_groups 0: the schedule's own bound
        zero_variance="drop",
        temperature=1.0,
        stop_tokens=(7, 8),
        interrupt=True,
        min_length_bucket=32,
        length_buckets_per_octave=8,
        sort_by_length=True,
        microbatches=48,
        seed=0,
        first_version=4096,
        mask_truncated=False,
        train_step_flops=flops,
        peak_flops_per_s=1e15,
    )


@pytest.mark.parametrize(
    "overrides, field, expected",
    [
        ({"num_steps": 100}, "num_steps", 0),  # resumed past the end: nothing left to train
        ({"data.answer_format": "plain"}, "interrupt", False),
        ({"rl.length_control": "length_penalty"}, "interrupt", False),
        ({"rl.refill_zero_variance": True}, "zero_variance", "refill"),
        ({"rl.zero_variance_filter": False}, "zero_variance", "none"),
        ({"schedule.queue_groups": 500}, "capacity", 500),
        ({"data.max_prompt_tokens": 8, "sampler.max_new_tokens": 16}, "min_length_bucket", 24),
        ({"seed": 2**32 - 1}, "seed", 2**32 - 1),
    ],
)
def test_each_switch_reaches_its_field(overrides, field, expected):
    config = recipes.scalerl_8b()
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        setattr(config[section] if section else config, name, value)
    built = pipeline_config_of(config, stop_tokens=[7], start_step=300)
    assert getattr(built, field) == expected
    assert built.train_step_flops is None and built.peak_flops_per_s is None
