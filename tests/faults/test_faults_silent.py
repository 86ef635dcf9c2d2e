"""Faults that used to pass silently, and what the run says about each: one test per class.

Settings a config makes irrelevant (scalerl_jax.config.relevance.check_irrelevant)
  N1 `model.checkpoint` beside a `warm_start` section: refused at start-up (exit 2) naming both keys,
     before the warm start is built
  N2 other settings the config ignores: refused (data.path under the synthetic task, refill without the
     filter) or one warning line each at start-up, naming both keys; shipped configs get neither
Reward failures (scalerl_jax.data.rewards.RewardTallies, scalerl_jax.run.build.make_reward_fn)
  N3 a custom reward raising on training and evaluation items: counted in every metrics row
     (data/reward_errors, eval/reward_errors, cumulative, restored on resume), first one logged once
  N4 a custom reward past the verifier's time limit on training items: data/reward_timeouts, logged once
  N5 a custom reward that kills its worker: data/reward_crashes, logged once
  N6 math-verify cannot parse an answer: data/reward_unparsable, logged once
Checkpoint tokenizer (scalerl_jax.run.sampling_setup.check_token_ids)
  N7 special, stop or think-end ids outside config.json's vocab_size: ConfigError naming the ids and files
"""

import json
import logging
import os
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import Any, cast

import jax
import pytest
from main_runs import REPO, SMALL

from scalerl_jax import data as data_lib
from scalerl_jax import run as run_lib
from scalerl_jax.config import recipes
from scalerl_jax.config.adapters import reward_config_of
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.relevance import check_irrelevant
from scalerl_jax.config.validation import validate
from scalerl_jax.config.variants import study_config
from scalerl_jax.data.rewards import FAILURE_METRICS, RewardTallies
from scalerl_jax.models import load_checkpoint_tokenizer
from scalerl_jax.pipeline.group import Prompt
from scalerl_jax.run.build import TaskData, build_policy_source, make_reward_fn
from scalerl_jax.telemetry.metrics import REWARD_FAILURE_KEYS, format_progress


def config_with(base: str, overrides: dict):
    config = recipes.tiny() if base == "tiny" else recipes.scalerl_8b()
    config.update_from_flattened_dict(overrides)
    return config


# ----------------------------------------------------------------------------------------------
# Settings a config makes irrelevant
# ----------------------------------------------------------------------------------------------


def test_n1_checkpoint_beside_a_warm_start_is_refused_naming_both_keys(tmp_path):
    config = config_with("tiny", {"model.checkpoint": str(tmp_path)})
    expected = (
        f"config key `model.checkpoint` = {str(tmp_path)!r} is not used: this config has a `warm_start` "
        "section, which builds and trains its own policy (configs/tiny.py). To train that checkpoint, use a "
        "config without `warm_start` (e.g. configs/scalerl_8b.py); to train the warm-started policy, leave "
        "`model.checkpoint` empty"
    )
    with pytest.raises(ConfigError) as raised:
        validate(config, check_files=False)
    assert raised.value.problems == [expected]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "scalerl_jax.main",
            "--config=configs/tiny.py",
            f"--workdir={tmp_path / 'run'}",
            f"--config.model.checkpoint={tmp_path}",
        ],
        cwd=REPO,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"config error: {expected}" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "warm_start").exists()


REFUSED = {
    "data.path under the synthetic task": (
        "tiny",
        {"data.path": "/data/mine.jsonl"},
        "config key `data.path` = '/data/mine.jsonl' is not used: `data.dataset` = 'synthetic' trains on the "
        "generated arithmetic task; set `data.dataset` to 'jsonl' or 'polaris_53k' to train on the file",
    ),
    "refill without the filter": (
        "8b",
        {"rl.refill_zero_variance": True, "rl.zero_variance_filter": False},
        "config keys `rl.refill_zero_variance` = True and `rl.zero_variance_filter` = False contradict each "
        "other: refilling drops zero-variance groups and samples new ones, so the run would filter them. Set "
        "`rl.zero_variance_filter` = True for DAPO's dynamic sampling, or `rl.refill_zero_variance` = False to "
        "train on every group",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_n2_irrelevant_settings_that_are_refused(case):
    base, overrides, expected = REFUSED[case]
    with pytest.raises(ConfigError) as raised:
        validate(config_with(base, overrides), check_files=False)
    assert raised.value.problems == [expected]


WARNED = {
    "eps_low under cispo": (
        {"rl.eps_low": 0.1},
        "config key `rl.eps_low` = 0.1 has no effect: `rl.objective` = 'cispo' truncates the importance "
        "weight at `rl.eps_max` and clips nothing",
    ),
    "eps_high under cispo": (
        {"rl.eps_high": 0.3},
        "config key `rl.eps_high` = 0.3 has no effect: `rl.objective` = 'cispo' truncates the importance "
        "weight at `rl.eps_max` and clips nothing",
    ),
    "eps_max under dapo": (
        {"rl.objective": "dapo", "rl.eps_max": 2.0},
        "config key `rl.eps_max` = 2.0 has no effect: `rl.objective` = 'dapo' clips the ratio at "
        "`rl.eps_low` / `rl.eps_high`; only cispo reads `rl.eps_max`",
    ),
    "positive_pass_rate without no_positive_resampling": (
        {"rl.no_positive_resampling": False, "rl.positive_pass_rate": 0.8},
        "config key `rl.positive_pass_rate` = 0.8 has no effect: `rl.no_positive_resampling` = False "
        "retires no prompts",
    ),
    "interruption under the plain answer format": (
        {"data.answer_format": "plain"},
        "config key `rl.length_control` = 'interruption' has no effect: `data.answer_format` = 'plain' has "
        "no think phase to interrupt, so completions end only at `sampler.max_new_tokens`; set "
        "`rl.length_control` to 'none' or 'length_penalty' to say so",
    ),
    "think_end under the plain answer format": (
        {"data.answer_format": "plain", "rl.length_control": "none", "sampler.think_end": "<|end|>"},
        "config key `sampler.think_end` = '<|end|>' has no effect: `data.answer_format` = 'plain' takes "
        "the last box of the whole completion and nothing interrupts thinking",
    ),
    "a length penalty that can never apply": (
        {"rl.length_control": "length_penalty", "rl.length_penalty_max": 20_000},
        "config keys `rl.length_penalty_max` = 20000 and `rl.length_penalty_cache` = 2048 have no effect: "
        "the penalty starts past 17952 tokens, and `sampler.max_new_tokens` = 14336 ends every completion "
        "before that",
    ),
    "reward_correct beside a custom reward": (
        {"data.reward_fn": "mine.rewards:score", "data.reward_correct": 2.0},
        "config key `data.reward_correct` = 2.0 has no effect: the custom reward `data.reward_fn` = "
        "'mine.rewards:score' gives every reward (`data.reward_incorrect` still scores its failures)",
    ),
    "wandb_mode without a project": (
        {"logging.wandb_mode": "online"},
        "config key `logging.wandb_mode` = 'online' has no effect: `logging.wandb_project` is empty, so "
        "nothing is sent to Weights & Biases",
    ),
}


@pytest.mark.parametrize("case", sorted(WARNED))
def test_n2_irrelevant_settings_that_are_warned_about(case, caplog):
    overrides, expected = WARNED[case]
    config = config_with("8b", overrides)
    assert check_irrelevant(config) == ([], [expected])
    with caplog.at_level(logging.WARNING):
        assert validate(config, check_files=False) == [expected]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [f"config: {expected}"]


def shipped_configs():
    yield "tiny", recipes.tiny()
    yield "scalerl_8b", recipes.scalerl_8b()
    for name in recipes.LEAVE_ONE_OUT:
        yield f"loo {name}", recipes.leave_one_out(name)
        yield f"study tiny {name}", study_config(f"configs/tiny.py,{name}")
    for name in recipes.PREVALENT:
        yield f"prevalent {name}", recipes.prevalent(name)
    for name in recipes.SCALE:
        yield f"scale {name}", recipes.scale(name)


def test_n2_shipped_configs_are_neither_refused_nor_warned_about():
    cwd = os.getcwd()
    os.chdir(REPO)  # study_config reads configs/tiny.py
    try:
        found = {name: check_irrelevant(config) for name, config in shipped_configs()}
    finally:
        os.chdir(cwd)
    assert {name: result for name, result in found.items() if result != ([], [])} == {}


# ----------------------------------------------------------------------------------------------
# Reward failures
# ----------------------------------------------------------------------------------------------

PROBLEM = "Compute 12 + 30 and then explain why the answer is what it is, at some length."


def decode(ids) -> str:
    return "".join(chr(i) for i in ids)


def encode(text: str) -> tuple[int, ...]:
    return tuple(ord(c) for c in text)


def reward_parts(config, *, time_limit_s: float = 5.0):
    """make_reward_fn on one training prompt (PROBLEM, gold '42') with a real verify pool."""
    reward_config = reward_config_of(config)
    verify_pool = data_lib.VerifyPool(1, time_limit_s=time_limit_s, reward_fn=reward_config.reward_fn)
    tallies = RewardTallies()
    task = TaskData([PROBLEM], [[1, 2]], ["42"], [], 0)
    tokens = cast(Any, SimpleNamespace(tokenizer=SimpleNamespace(decode=decode)))
    pool = data_lib.PromptPool(1, seed=0, npr_threshold=None)
    reward_fn = make_reward_fn(config, tokens, reward_config, verify_pool, pool, task, tallies)
    return reward_fn, verify_pool, tallies


def score_twice(reward_fn, text: str) -> list[list[float]]:
    completions = [SimpleNamespace(tokens=list(encode(text)))] * 2
    return [reward_fn(Prompt(0, (1, 2)), completions) for _ in range(2)]


def counts(errors=0, timeouts=0, crashes=0, unparsable=0, items=4, found=0, prefix="data") -> dict[str, float]:
    """A tally's metrics; the training scope also reports the fraction of items whose answer was
    found and its count of steps without answers (none here: no step is taken)."""
    fraction = {f"{prefix}/answer_found_frac": found / items} if prefix == "data" and items else {}
    if prefix == "data":
        fraction[f"{prefix}/steps_without_answers"] = 0
    return {
        f"{prefix}/reward_items": items,
        f"{prefix}/answers_found": found,
        **fraction,
        f"{prefix}/reward_errors": errors,
        f"{prefix}/reward_timeouts": timeouts,
        f"{prefix}/reward_crashes": crashes,
        f"{prefix}/reward_unparsable": unparsable,
    }


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "reward" in r.getMessage()]


def first_item_line(outcome: str, metric: str, reason: str) -> str:
    return (
        f"reward {outcome} on a training item (counted in {metric}; only the first is logged): "
        f"problem {PROBLEM[:60]!r}..., gold '42': {reason}"
    )


@pytest.mark.parametrize(
    "spec, time_limit_s, expected, reason",
    [
        (
            "silent_rewards:hangs_on_training",
            1.0,
            counts(timeouts=4),
            ("timeout", "data/reward_timeouts", "no answer within time_limit_s=1.0"),
        ),
        (
            "silent_rewards:crashes_on_training",
            5.0,
            counts(crashes=4),
            ("crash", "data/reward_crashes", "worker died"),
        ),
    ],
    ids=["n4_timeout", "n5_crash"],
)
def test_n4_n5_custom_reward_timeouts_and_crashes_on_training_items_are_counted(
    spec, time_limit_s, expected, reason, caplog
):
    config = config_with("tiny", {"data.reward_fn": spec})
    reward_fn, verify_pool, tallies = reward_parts(config, time_limit_s=time_limit_s)
    try:
        with caplog.at_level(logging.WARNING):
            rewards = score_twice(reward_fn, "</think>\\boxed{42}")
    finally:
        verify_pool.close()
    assert rewards == [[-1.0, -1.0], [-1.0, -1.0]]
    assert tallies.metrics() == expected
    assert [w for w in warnings_of(caplog) if w.startswith("reward ")] == [first_item_line(*reason)]


def test_n3_custom_reward_errors_on_training_items_are_counted(caplog):
    config = config_with("tiny", {"data.reward_fn": "silent_rewards:raises_on_training"})
    reward_fn, verify_pool, tallies = reward_parts(config)
    try:
        with caplog.at_level(logging.WARNING):
            rewards = score_twice(reward_fn, "</think>\\boxed{42}")
    finally:
        verify_pool.close()
    assert rewards == [[-1.0, -1.0], [-1.0, -1.0]]
    assert tallies.metrics() == counts(errors=4, found=4)  # the box was found before the function raised
    assert warnings_of(caplog) == [
        first_item_line("error", "data/reward_errors", "raised RuntimeError: cannot score gold '42'")
    ]
    restored = RewardTallies()
    restored.load_state_dict(json.loads(json.dumps(tallies.state_dict())))  # as the checkpoint stores it
    assert restored.metrics() == counts(errors=4, found=4)


def test_n6_unparsable_answers_are_counted(caplog):
    config = recipes.scalerl_8b()  # math-verify
    reward_fn, verify_pool, tallies = reward_parts(config)
    try:
        with caplog.at_level(logging.WARNING):
            rewards = score_twice(reward_fn, "</think>\\boxed{}")
    finally:
        verify_pool.close()
    assert rewards == [[-1.0, -1.0], [-1.0, -1.0]]
    assert tallies.metrics() == counts(unparsable=4, found=4)  # an empty box is an answer, unparsable
    assert warnings_of(caplog) == [
        first_item_line("unparsable", "data/reward_unparsable", "math-verify could not parse the prediction ''")
    ]


def test_n3_the_progress_line_counts_every_failure_kind():
    assert REWARD_FAILURE_KEYS == tuple(f"data/{name}" for name in FAILURE_METRICS.values())


def test_n3_the_progress_line_shows_reward_failures_once_there_are_any():
    assert "reward failures" not in format_progress(1, 2, counts(), None)
    assert format_progress(1, 2, counts(errors=3, timeouts=1, items=9), None).endswith(" | eta - | reward failures 4")


def read_metrics(workdir) -> dict[int, dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {row["step"]: row for row in map(json.loads, f)}


def test_n3_reward_errors_in_a_run_are_in_every_row_and_survive_resume(tmp_path, caplog):
    config = recipes.tiny()
    overrides = {"rl.zero_variance_filter": False, "data.reward_fn": "silent_rewards:raises_on_training"}
    config.update_from_flattened_dict({**SMALL, **overrides})
    validate(config, num_devices=len(jax.devices()))
    with caplog.at_level(logging.WARNING):
        run_lib.run(config, str(tmp_path))
    rows = read_metrics(tmp_path)
    assert sorted(rows) == [0, 1, 2, 3]
    # Evaluations at steps 0, 2 and 3, each 4 prompts x 2 samples, every one an error.
    assert [rows[s]["eval/reward_errors"] for s in range(4)] == [8, 8, 16, 24]
    assert [rows[s]["eval/reward_items"] for s in range(4)] == [8, 8, 16, 24]
    for step in range(1, 4):  # every training item scored so far is an error
        assert rows[step]["data/reward_errors"] == rows[step]["data/reward_items"] >= 8 * step
        assert rows[step]["data/reward_timeouts"] == rows[step]["data/reward_crashes"] == 0
    logged = warnings_of(caplog)
    assert len([w for w in logged if w.startswith("reward error on a training item")]) == 1
    assert len([w for w in logged if w.startswith("reward error on an item of evaluation set 'eval'")]) == 1
    assert re.search(
        r"reward error on a training item \(counted in data/reward_errors; only the first is logged\): "
        r"problem '.+', gold '-?\d+': raised RuntimeError: cannot score gold '-?\d+'",
        "\n".join(logged),
    )
    trained_before = rows[3]["data/reward_errors"]
    config.unlock()
    config.num_steps = 4
    run_lib.run(config, str(tmp_path))  # resumes from the checkpoint of step 3
    rows = read_metrics(tmp_path)
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert rows[4]["eval/reward_errors"] == 32  # 24 restored + 8 at step 4
    assert rows[4]["data/reward_errors"] == rows[4]["data/reward_items"] >= trained_before + 8


# ----------------------------------------------------------------------------------------------
# Checkpoint tokenizer
# ----------------------------------------------------------------------------------------------


def test_n7_tokenizer_ids_outside_the_model_vocabulary_are_refused(tmp_path):
    from family_checkpoints import make_family_checkpoint

    checkpoint = make_family_checkpoint("qwen3", str(tmp_path / "model"))
    config = recipes.scalerl_8b()
    config.model.checkpoint = checkpoint
    build_policy_source(config, str(tmp_path / "run"))  # as written: every id fits
    tokens = load_checkpoint_tokenizer(checkpoint)
    think_end = tokens.tokenizer.token_to_id("</think>")
    model_config = json.loads((tmp_path / "model" / "config.json").read_text())
    model_config["vocab_size"] = min(tokens.stop_ids)  # every stop id and the think-end tag fall outside
    (tmp_path / "model" / "config.json").write_text(json.dumps(model_config))
    assert tokens.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    vocab = tokens.tokenizer.get_vocab(with_added_tokens=True)
    outside = [
        f"tokenizer.json has {len(vocab)} tokens (ids up to {max(vocab.values())})",
        f"eos_token '<|im_end|>' = {tokens.eos_id}",
        f"pad_token '<|endoftext|>' = {tokens.pad_id}",
        f"stop ids {list(tokens.stop_ids)}",
    ]
    outside.append(f"think-end tag `sampler.think_end` {'</think>'!r} = {think_end}")
    expected = (
        f"{checkpoint}/config.json: vocab_size = {model_config['vocab_size']}, but the tokenizer files of "
        f"{checkpoint} (tokenizer.json, tokenizer_config.json, generation_config.json) give ids outside it: "
        f"{'; '.join(outside)}. The model has no rows for them: a tokenizer from another model?"
    )
    with pytest.raises(ConfigError) as raised:
        build_policy_source(config, str(tmp_path / "run"))
    assert raised.value.problems == [expected]
