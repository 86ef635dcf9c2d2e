"""mesh.generator_fraction='auto': the split rule against hand-computed cases, and its config checks."""

import json

import pytest

from scalerl_jax.config import recipes
from scalerl_jax.config.argv import parse_config_argv
from scalerl_jax.config.devices import check_devices, split_candidates
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.resume import config_json
from scalerl_jax.config.validation import validate
from scalerl_jax.models import split_devices
from scalerl_jax.run.device_split import (
    Rates,
    choose_split,
    predict_split,
    resolve_generator_fraction,
    saved_fraction,
    with_fraction,
)


def test_predict_split_by_hand():
    # 100 completion tokens a sample, no prompt: generating takes 100 / (g x 100) = 1/g s, training
    # 100 / (t x 50) = 2/t s. 1 / 3: step max(1, 2/3) = 1 s, the trainer idle 1/3.
    rates = Rates(generate_tokens_per_s=100.0, train_tokens_per_s=50.0, prompt_tokens=0.0, completion_tokens=100.0)
    assert predict_split(rates, 1, 3) == pytest.approx((1.0, 0.0, 1 / 3))
    assert predict_split(rates, 2, 2) == pytest.approx((1.0, 0.5, 0.0))
    assert predict_split(rates, 3, 1) == pytest.approx((2.0, 5 / 6, 0.0))


def test_choose_split_ties_go_to_the_smaller_max_idle():
    # Same rates over 4 devices: 1 / 3 and 2 / 2 both take 1 s a sample; max idle 1/3 vs 1/2.
    rates = Rates(generate_tokens_per_s=100.0, train_tokens_per_s=50.0, prompt_tokens=0.0, completion_tokens=100.0)
    pick = choose_split(rates, 4, [1, 2, 3])
    assert (pick.num_generators, pick.num_trainers, pick.fraction) == (1, 3, 0.25)
    assert "balanced at 1.33 of 4" in pick.reasoning  # 4 / (1 + 100 x 100 / (50 x 100))
    assert "picked 1 / 3" in pick.reasoning and "ties" in pick.reasoning
    assert [row[0] for row in pick.predicted] == [1, 2, 3]


def test_choose_split_counts_prompt_tokens_in_training():
    # Equal per-device rates, but training also reads the 100 prompt tokens: 1/g s to generate,
    # 200 / (t x 100) = 2/t s to train. Over 6 devices, 2 / 4 balances exactly (0.5 s each).
    rates = Rates(generate_tokens_per_s=100.0, train_tokens_per_s=100.0, prompt_tokens=100.0, completion_tokens=100.0)
    pick = choose_split(rates, 6, range(1, 6))
    assert (pick.num_generators, pick.num_trainers) == (2, 4)
    assert pick.fraction == pytest.approx(1 / 3)
    assert split_devices(range(6), pick.fraction) == ([4, 5], [0, 1, 2, 3])  # the fraction gives that split
    # Only 1 / 5 and 3 / 3 allowed: 1 / 5 takes max(1, 0.4) = 1 s, 3 / 3 max(1/3, 2/3) = 2/3 s.
    pick = choose_split(rates, 6, [1, 3])
    assert pick.num_generators == 3
    assert pick.predicted[1][1:] == pytest.approx((2 / 3, 0.5, 0.0))


def test_choose_split_one_device_and_bad_input():
    rates = Rates(generate_tokens_per_s=10.0, train_tokens_per_s=10.0, prompt_tokens=1.0, completion_tokens=1.0)
    pick = choose_split(rates, 1, [1])
    assert (pick.num_generators, pick.num_trainers, pick.fraction) == (1, 1, 0.5)
    assert "share" in pick.reasoning
    with pytest.raises(ValueError, match="generator counts"):
        choose_split(rates, 4, [4])
    with pytest.raises(ValueError, match="train_tokens_per_s"):
        choose_split(Rates(1.0, 0.0, 1.0, 1.0), 4, [1])


def auto(config):
    config.mesh.generator_fraction = "auto"
    return config


def test_config_accepts_auto_and_refuses_other_strings():
    validate(auto(recipes.tiny()), check_files=False)
    config = recipes.tiny()
    config.mesh.generator_fraction = "half"
    with pytest.raises(ConfigError, match=r"`mesh.generator_fraction` = 'half'; expected .* or 'auto'"):
        validate(config, check_files=False)
    config.mesh.generator_fraction = 1.0
    with pytest.raises(ConfigError, match="mesh.generator_fraction"):
        validate(config, check_files=False)
    # The command line takes either kind.
    for value, expected in (("auto", "auto"), ("0.25", 0.25)):
        parsed = parse_config_argv(["x", "--config=configs/tiny.py", f"--config.mesh.generator_fraction={value}"])
        assert parsed is not None and parsed.mesh.generator_fraction == expected


def test_split_candidates_by_hand():
    # 8B recipe on 80 devices: 16 rows per microbatch -> t in {1, 2, 4, 8, 16}; 256 decode slots
    # over g in {79, 78, 76, 72, 64} generator devices split evenly only for 64.
    assert split_candidates(auto(recipes.scalerl_8b()), 80) == [64]
    # tiny: 128 rows -> t in {1, 2, 4}; 64 slots over g. 4 devices: g = 3 (64 % 3 != 0) or 2; one
    # device: shared.
    assert split_candidates(auto(recipes.tiny()), 4) == [2]
    assert split_candidates(auto(recipes.tiny()), 1) == [1]
    # Over 2 processes [0, 0, 1, 1] with 63 slots: g = 3 puts 2 generators on process 1 and g = 2
    # both there; 63 does not split over 2; g = 1 leaves 3 trainers for 128 rows. Nothing runs.
    config = auto(recipes.tiny())
    config.sampler.num_slots = 63
    assert split_candidates(config, 4, [0, 0, 1, 1]) == []
    assert split_candidates(config, 4) == [3]  # one process: g = 3 (63 % 3 == 0, 128 % 1 == 0)


def test_check_devices_with_auto():
    assert check_devices(auto(recipes.tiny()), 2) is None
    config = auto(recipes.tiny())
    config.mesh.trainer_shape = (1, 1, 1)  # exactly one trainer: g = 2 of 3, and 63 slots do not split over 2
    config.sampler.num_slots = 63
    with pytest.raises(ConfigError, match="'auto': no split of 3 devices"):
        check_devices(config, 3)
    assert with_fraction(config, 0.5).mesh.generator_fraction == 0.5
    assert config.mesh.generator_fraction == "auto"  # the copy leaves the original alone
    with pytest.raises(ValueError, match="resolve it to a number first"):
        split_devices(range(2), "auto")  # pyright: ignore[reportArgumentType]


def test_resolve_keeps_numbers_and_a_resumed_runs_split(tmp_path):
    config = recipes.tiny()
    assert resolve_generator_fraction(config, str(tmp_path)) is config  # a number: nothing measured
    # A workdir with checkpoints and a config.json that recorded 0.75 resumes with 0.75.
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.json").write_text(json.dumps(config_json(with_fraction(config, 0.75))))
    assert saved_fraction(str(tmp_path)) == 0.75
    resolved = resolve_generator_fraction(auto(recipes.tiny()), str(tmp_path))
    assert resolved.mesh.generator_fraction == 0.75
    (tmp_path / "config.json").write_text("{}")
    assert saved_fraction(str(tmp_path)) is None


def test_compile_check_refuses_auto():
    from scalerl_jax.run.programs import run_roles

    with pytest.raises(ConfigError, match="set the number"):
        run_roles(auto(recipes.tiny()), [])
