"""Settings that another key makes irrelevant: refused when ignoring them would change what the run
trains, warned about (one line each) when the run merely ignores them.
"""

from __future__ import annotations

import ml_collections

from scalerl_jax.config import schema
from scalerl_jax.config.schema import get_key
from scalerl_jax.data.answers import BOXED, HASHES, parse_styles
from scalerl_jax.data.builders import dataset_kind


def answer_style_warnings(config: ml_collections.ConfigDict) -> list[str]:
    """One line each: the prompt template asks for a `\\boxed{}` answer but `boxed` is not among
    `data.answer_extraction`'s styles, or for a `####` line without `hashes` (the reward would not
    read what the model is told to write); `data.gold_extraction` under the synthetic task (its
    golds are generated). Assumes `check_values` passed."""
    warnings = []
    d = config.data
    styles = parse_styles(d.answer_extraction)
    for marker, asked, style in (("\\boxed", "\\boxed{}", BOXED), ("####", "####", HASHES)):
        if marker in d.prompt_template and style not in styles:
            warnings.append(
                f"config key `data.prompt_template` asks for {asked} but `data.answer_extraction` = "
                f"{d.answer_extraction!r} does not read it; add {style!r} to `data.answer_extraction` or change "
                "the template"
            )
    if d.gold_extraction and d.dataset in ("synthetic", "ladder"):
        warnings.append(
            f"config key `data.gold_extraction` = {d.gold_extraction!r} has no effect: `data.dataset` = "
            f"{d.dataset!r} generates its gold answers"
        )
    return warnings


def check_irrelevant(config: ml_collections.ConfigDict) -> tuple[list[str], list[str]]:
    """Settings that another key makes irrelevant: `(problems, warnings)`, each naming both keys.

    Refused (problems): a setting whose being ignored changes what the run trains, so the run
    would not be the one asked for: `model.checkpoint` beside a `warm_start` section (the
    warm-started policy is trained instead), `data.path` under the synthetic task (the generated
    task is trained instead), `rl.refill_zero_variance` with `rl.zero_variance_filter` off (the
    refill filters anyway). Warned about (one line each): a value the run ignores without
    changing what it trains: clip ranges of an objective that does not read them, the positive
    pass rate without No-Positive-Resampling, interruption or a think-end tag under
    `answer_format='plain'`, a length penalty that starts past `sampler.max_new_tokens`,
    `data.reward_correct` beside a custom reward, a wandb mode without a project. Keys with a
    default are flagged only when they differ from the baseline recipe's value, so a config that
    merely carries the defaults (every shipped one) gets no line. Assumes `check_values` passed.
    """
    problems: list[str] = []
    warnings: list[str] = []
    baseline = schema.default_config()
    d, rl, s = config.data, config.rl, config.sampler

    def changed(key: str) -> bool:
        return get_key(config, key) != get_key(baseline, key)

    if "warm_start" in config and config.model.checkpoint:
        problems.append(
            f"config key `model.checkpoint` = {config.model.checkpoint!r} is not used: this config has a "
            "`warm_start` section, which builds and trains its own policy (configs/tiny.py). To train that "
            "checkpoint, use a config without `warm_start` (e.g. configs/scalerl_8b.py); to train the "
            "warm-started policy, leave `model.checkpoint` empty"
        )
    if d.dataset in ("synthetic", "ladder") and d.path:
        problems.append(
            f"config key `data.path` = {d.path!r} is not used: `data.dataset` = {d.dataset!r} trains on the "
            "generated arithmetic task; set `data.dataset` to 'jsonl' or 'polaris_53k' to train on the file"
        )
    if d.max_solution_steps and dataset_kind(d.dataset, d.path) != "jsonl":
        problems.append(
            f"config key `data.max_solution_steps` = {d.max_solution_steps} is not used: it narrows a local "
            f"jsonl/parquet file of worked solutions, and `data.dataset` = {d.dataset!r} with `data.path` = "
            f"{d.path!r} reads {dataset_kind(d.dataset, d.path)!r}; set it to 0"
        )
    if rl.refill_zero_variance and not rl.zero_variance_filter:
        problems.append(
            "config keys `rl.refill_zero_variance` = True and `rl.zero_variance_filter` = False contradict each "
            "other: refilling drops zero-variance groups and samples new ones, so the run would filter them. "
            "Set `rl.zero_variance_filter` = True for DAPO's dynamic sampling, or `rl.refill_zero_variance` = "
            "False to train on every group"
        )
    if rl.objective == "cispo":
        for key in ("rl.eps_low", "rl.eps_high"):
            if changed(key):
                warnings.append(
                    f"config key `{key}` = {get_key(config, key)!r} has no effect: `rl.objective` = 'cispo' "
                    "truncates the importance weight at `rl.eps_max` and clips nothing"
                )
    elif changed("rl.eps_max"):
        warnings.append(
            f"config key `rl.eps_max` = {rl.eps_max!r} has no effect: `rl.objective` = {rl.objective!r} clips "
            "the ratio at `rl.eps_low` / `rl.eps_high`; only cispo reads `rl.eps_max`"
        )
    if not rl.no_positive_resampling and changed("rl.positive_pass_rate"):
        warnings.append(
            f"config key `rl.positive_pass_rate` = {rl.positive_pass_rate!r} has no effect: "
            "`rl.no_positive_resampling` = False retires no prompts"
        )
    if d.answer_format == "plain":
        if rl.length_control == "interruption":
            warnings.append(
                "config key `rl.length_control` = 'interruption' has no effect: `data.answer_format` = 'plain' "
                "has no think phase to interrupt, so completions end only at `sampler.max_new_tokens`; set "
                "`rl.length_control` to 'none' or 'length_penalty' to say so"
            )
        if changed("sampler.think_end"):
            warnings.append(
                f"config key `sampler.think_end` = {s.think_end!r} has no effect: `data.answer_format` = "
                "'plain' takes the last box of the whole completion and nothing interrupts thinking"
            )
    start = rl.length_penalty_max - rl.length_penalty_cache
    if rl.length_control == "length_penalty" and start >= s.max_new_tokens:
        warnings.append(
            f"config keys `rl.length_penalty_max` = {rl.length_penalty_max} and `rl.length_penalty_cache` = "
            f"{rl.length_penalty_cache} have no effect: the penalty starts past {start} tokens, and "
            f"`sampler.max_new_tokens` = {s.max_new_tokens} ends every completion before that"
        )
    if d.reward_fn and changed("data.reward_correct"):
        warnings.append(
            f"config key `data.reward_correct` = {d.reward_correct!r} has no effect: the custom reward "
            f"`data.reward_fn` = {d.reward_fn!r} gives every reward (`data.reward_incorrect` still scores "
            "its failures)"
        )
    if not config.logging.wandb_project and changed("logging.wandb_mode"):
        warnings.append(
            f"config key `logging.wandb_mode` = {config.logging.wandb_mode!r} has no effect: "
            "`logging.wandb_project` is empty, so nothing is sent to Weights & Biases"
        )
    return problems, warnings
