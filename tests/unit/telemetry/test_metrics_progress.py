"""The per-step progress line (metrics.format_progress) on a hand-built metrics dict."""

from scalerl_jax.telemetry.metrics import format_progress


def test_progress_line_has_entropy_and_response_length():
    metrics = {
        "train/reward_mean": 0.25,
        "train/loss": -0.0123,
        "train/entropy": 0.51234,
        "train/completion_len_mean": 812.4,
        "train/completion_len_max": 4096.0,
        "sampler/tokens_per_s": 1234.5,
        "pipeline/lag_mean": 1.5,
        "pipeline/lag_max": 3,
        "sampler/interrupted_frac": 0.1,
        "sampler/truncated_frac": 0.05,
        "data/zero_variance_dropped": 2,
        "compute/device_hours": 0.125,
    }
    line = format_progress(7, 100, metrics, 90.0, last_eval=(5, 0.5))
    assert line == (
        "step 7/100 | pass 0.500@5 | reward +0.250 | loss -0.0123 ent 0.512"
        " | len 812/4096 | tok/s 1234 | lag 1.50/3 | interrupted 0.10 truncated 0.05"
        " | zv-dropped 2 | dev-h 0.1250 | eta 1.5m"
    )


def test_missing_entropy_and_length_show_a_dash():
    line = format_progress(1, 2, {}, None)
    assert " ent - | len -/- | " in line


def test_a_step_without_any_answer_says_so_with_the_runs_count():
    line = format_progress(3, 10, {"data/step_answer_found_frac": 0.0, "data/steps_without_answers": 2}, None)
    assert line.endswith(
        " | no answer found in any completion of this step by data.answer_extraction's styles (2 such steps so far)"
    )
    assert "no answer found" not in format_progress(3, 10, {"data/step_answer_found_frac": 0.02}, None)
    assert "no answer found" not in format_progress(3, 10, {}, None)
