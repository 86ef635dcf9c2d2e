"""`python -m scalerl_jax.cli.evaluate`: the reported mean@K, pass@k and per-group numbers equal a hand
computation (math.comb) from the per-sample correctness it writes, and that correctness equals
what the completion texts say.

The policy is a hand-set "bigram" Llama (see `policy_fixtures.make_bigram_base`): after the
prompt it writes `</think>\\boxed{` then `3` or `4` with probability 1/2 each, then `}` and eos, so
through the real sampler and verifier each sample is right with probability 1/2 against a gold
of 3 or 4, and the correctness matrix has both values.
"""

import json
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from repo_paths import GSM8K_DIR, REPO

pytest.importorskip("torch")
pytest.importorskip("transformers")

import policy_fixtures  # noqa: E402

from scalerl_jax import data as data_lib  # noqa: E402
from scalerl_jax.cli import evaluate  # noqa: E402
from scalerl_jax.run import benchmark as benchmark_lib  # noqa: E402

TINY_CONFIG = os.path.join(REPO, "configs", "tiny.py")
ROWS = [
    {"problem": f"What is {a} + {b}?", "answer": a + b, "level": 1 + i % 2}
    for i, (a, b) in enumerate([(1, 2), (2, 2), (0, 3), (3, 1), (1, 3), (4, 0)])
]


def _bigram_transitions(tokenizer, last_prompt_token: int) -> dict[int, tuple[int, ...]]:
    """prompt end -> </think> \\ boxed { -> (3 | 4) -> } -> eos, from the tokenizer's own ids."""
    eos = tokenizer.token_to_id("</s>")  # the name train_tokenizer gives its eos
    three = tokenizer.encode("</think>\\boxed{3}", add_special_tokens=False).ids + [eos]
    four = tokenizer.encode("</think>\\boxed{4}", add_special_tokens=False).ids + [eos]
    assert len(three) == len(four) and sum(a != b for a, b in zip(three, four)) == 1
    transitions: dict[int, set[int]] = {last_prompt_token: {three[0]}}
    for chain in (three, four):
        for current, following in zip(chain, chain[1:]):
            transitions.setdefault(current, set()).add(following)
    assert len(set(three)) == len(three) and last_prompt_token not in three  # no token has two roles
    return {k: tuple(sorted(v)) for k, v in transitions.items()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(run_dir, base_dir, jsonl path, parquet path)."""
    root = tmp_path_factory.mktemp("evaluate")
    base_dir = str(root / "base")
    tokenizer = policy_fixtures.train_test_tokenizer(base_dir)
    encoder = data_lib.PromptEncoder(tokenizer, data_lib.PromptFormat(template=policy_fixtures.PROMPT_TEMPLATE))
    last_tokens = {encoder.encode_unchecked(row["problem"])[-1] for row in ROWS}
    assert len(last_tokens) == 1
    policy_fixtures.make_bigram_base(base_dir, _bigram_transitions(tokenizer, last_tokens.pop()))
    config = policy_fixtures.run_config(base_dir, answer_budget=8)
    run_dir = str(root / "run")
    policy_fixtures.make_run_dir(run_dir, config, step_seeds={3: None})
    jsonl = root / "bench.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    parquet = root / "bench.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)  # integer answers: taken as str(value)
    return run_dir, base_dir, str(jsonl), str(parquet)


def _hand_pass_at_k(correct: list[list[bool]], k: int) -> float:
    n = len(correct[0])
    return float(np.mean([1 - math.comb(n - sum(c), k) / math.comb(n, k) for c in correct]))


def _check_report(report, samples, ks):
    per_prompt = report["per_prompt"]
    assert [p["row"] for p in per_prompt] == list(range(len(ROWS)))
    for p in per_prompt:
        assert p["answer"] == str(ROWS[p["row"]]["answer"]) and len(p["correct"]) == samples
        for correct, text in zip(p["correct"], p["completions"]):
            assert correct == (text == f"</think>\\boxed{{{p['answer']}}}"), text
    correct = [p["correct"] for p in per_prompt]
    flat = sum(correct, [])
    assert 0 < sum(flat) < len(flat)  # both outcomes occur: the numbers below are not trivial
    metrics = report["metrics"]
    assert metrics[f"mean@{samples}"] == pytest.approx(np.mean([sum(c) / samples for c in correct]), abs=1e-12)
    for k in ks:
        assert metrics[f"pass@{k}"] == pytest.approx(_hand_pass_at_k(correct, k), abs=1e-12)
    for level in ("1", "2"):
        group = [p["correct"] for p in per_prompt if p["group"] == level]
        assert report["groups"][level]["num_prompts"] == len(group) == 3
        assert report["groups"][level][f"mean@{samples}"] == pytest.approx(
            np.mean([sum(c) / samples for c in group]), abs=1e-12
        )
        for k in ks:
            assert report["groups"][level][f"pass@{k}"] == pytest.approx(_hand_pass_at_k(group, k), abs=1e-12)
    return correct


@pytest.mark.slow  # ~40 s on 2 shared cores: two sampler compiles on 8 CPU devices
def test_evaluate_run_dir_jsonl_and_parquet(setup, tmp_path, capsys):
    run_dir, _, jsonl, parquet = setup
    correct = {}
    for name, path in (("jsonl", jsonl), ("parquet", parquet)):
        out = tmp_path / f"{name}.json"
        assert (
            evaluate.main(
                [
                    "--checkpoint",
                    run_dir,
                    "--data",
                    path,
                    "--samples",
                    "4",
                    "--k",
                    "1,2,4",
                    "--group-field",
                    "level",
                    "--out",
                    str(out),
                    "--completions",
                ]
            )
            == 0
        )
        report = json.loads(out.read_text())
        assert report["step"] == 3 and report["sampling"]["reward_kind"] == "exact"
        correct[name] = _check_report(report, 4, (1, 2, 4))
        printed = capsys.readouterr().out
        assert "mean@4" in printed and "level=2" in printed
    assert correct["jsonl"] == correct["parquet"]  # same prompts, seeds and sampler


@pytest.mark.slow  # ~20 s: one sampler compile
def test_evaluate_hf_dir_with_config_overrides(setup, tmp_path):
    _, base_dir, jsonl, _ = setup
    out = tmp_path / "hf.json"
    assert (
        evaluate.main(
            [
                "--checkpoint",
                base_dir,
                "--data",
                jsonl,
                "--samples",
                "2",
                "--k",
                "1,2",
                "--group-field",
                "level",
                "--out",
                str(out),
                "--completions",
                f"--config={TINY_CONFIG}",
                "--config.sampler.num_slots=8",
                "--config.sampler.max_new_tokens=16",
                "--config.sampler.think_budget_min=8",
                "--config.sampler.think_budget_max=10",
                "--config.sampler.answer_budget=8",
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["step"] is None and report["sampling"]["max_new_tokens"] == 16
    _check_report(report, 2, (1, 2))


@pytest.mark.slow  # ~40 s: two evaluations of the run, one sampler compile each
def test_an_evaluation_in_two_parts_merges_into_the_whole(setup, tmp_path, capsys):
    from scalerl_jax.cli import merge_evals

    run_dir, _, jsonl, _ = setup
    parts = []
    for problems in ("0:2", "2:"):
        parts.append(str(tmp_path / f"part{len(parts)}.json"))
        argv = ["--checkpoint", run_dir, "--data", jsonl, "--samples", "4", "--k", "1,2,4", "--group-field", "level"]
        assert evaluate.main([*argv, "--problems", problems, "--out", parts[-1], "--completions"]) == 0
    assert [json.loads(open(p).read())["problems"] for p in parts] == [
        {"start": 0, "end": 2, "of": 6},
        {"start": 2, "end": 6, "of": 6},
    ]
    assert [len(json.loads(open(p).read())["per_prompt"]) for p in parts] == [2, 4]
    out = tmp_path / "all.json"
    assert merge_evals.main([*parts, "--out", str(out)]) == 0
    assert "problems covered: 6 of 6" in capsys.readouterr().out
    _check_report(json.loads(out.read_text()), 4, (1, 2, 4))


def test_parquet_and_jsonl_read_alike_with_str_answers(setup):
    _, _, jsonl, parquet = setup
    from_jsonl = benchmark_lib.read_benchmark(jsonl, group_field="level")
    from_parquet = benchmark_lib.read_benchmark(parquet, group_field="level")
    assert from_jsonl.answers == from_parquet.answers == [str(row["answer"]) for row in ROWS]
    assert from_jsonl.problems == from_parquet.problems and from_parquet.groups == ["1", "2"] * 3


def test_summaries_match_a_hand_computation():
    correct = np.array([[1, 0, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    # c = 1, 3, 0, 4 of K = 4: mean@4 = (1/4 + 3/4 + 0 + 1) / 4; pass@2 = (1 - 3/6 + 1 - 0 + 0 + 1) / 4
    summary = benchmark_lib.summarize(correct, (1, 2))
    assert summary["mean@4"] == pytest.approx(0.5) and summary["pass@1"] == pytest.approx(0.5)
    assert summary["pass@2"] == pytest.approx((0.5 + 1.0 + 0.0 + 1.0) / 4)
    groups = benchmark_lib.summarize_groups(correct, ["a", "b", "a", "b"], (2,))
    assert groups["a"]["mean@4"] == pytest.approx(0.125) and groups["a"]["pass@2"] == pytest.approx(0.25)
    assert groups["b"]["num_prompts"] == 2 and groups["b"]["pass@2"] == pytest.approx(1.0)


def test_evaluate_errors_name_the_problem(setup, tmp_path, capsys):
    run_dir, base_dir, jsonl, _ = setup

    def fails(argv, *phrases):
        assert evaluate.main(argv) == 2
        err = capsys.readouterr().err
        for phrase in phrases:
            assert phrase in err, err

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "a", "answer": 1}) + "\n" + json.dumps({"problem": "b"}) + "\n")
    fails(["--checkpoint", run_dir, "--data", str(bad)], str(bad), "row 1", "'answer'")
    fails(["--checkpoint", run_dir, "--data", jsonl, "--group-field", "subject"], "row 0", "'subject'")
    fails(["--checkpoint", run_dir, "--data", jsonl, "--samples", "4", "--k", "1,8"], "--k", "bad: [8]")
    fails(["--checkpoint", run_dir, "--data", str(tmp_path / "x.csv")], "does not exist")
    (tmp_path / "x.csv").write_text("problem,answer\n")
    fails(["--checkpoint", run_dir, "--data", str(tmp_path / "x.csv")], "unknown suffix '.csv'")
    fails(["--checkpoint", run_dir, "--data", jsonl, f"--config={TINY_CONFIG}"], "uses its config.json")
    fails(["--checkpoint", base_dir, "--data", jsonl, "--step", "3"], "--step is for run directories")
    fails(["--checkpoint", str(tmp_path / "nope"), "--data", jsonl], "does not exist")
    fails(["--checkpoint", run_dir, "--data", jsonl, "--step", "5"], "no checkpoint at step 5", "[3]")
    fails(["--checkpoint", run_dir, "--data", jsonl, "--problems", "2-4"], "--problems '2-4' is not START:END")
    fails(["--checkpoint", run_dir, "--data", jsonl, "--problems", "4:9"], "need 0 <= START < END <= 6")
    fails(["--checkpoint", run_dir, "--data", jsonl, "--problems", "3:3"], "need 0 <= START < END <= 6")


def test_problem_ranges_by_hand():
    assert evaluate.parse_problem_range(":", 6) == (0, 6)
    assert evaluate.parse_problem_range("2:", 6) == (2, 6)
    assert evaluate.parse_problem_range(":4", 6) == (0, 4)
    benchmark = benchmark_lib.Benchmark(
        path="f", problems=list("abcdef"), answers=list("123456"), groups=list("xyxyxy"), rows=[0, 2, 3, 5, 8, 9]
    )
    part = benchmark.take(*evaluate.parse_problem_range("1:3", 6))
    assert (part.problems, part.answers, part.groups, part.rows) == (["b", "c"], ["2", "3"], ["y", "x"], [2, 3])


def test_overrides_without_a_config_file_apply_to_the_recipe_and_the_run(setup):
    run_dir, base_dir, _, _ = setup
    is_run, config = evaluate.load_config(base_dir, ["--config.data.answer_format=plain"])
    assert not is_run and config.data.answer_format == "plain"
    assert config.sampler.num_slots == 256  # the rest is the recipe's (configs/scalerl_8b.py)
    saved = json.load(open(os.path.join(run_dir, "config.json")))
    is_run, config = evaluate.load_config(run_dir, ["--config.sampler.max_new_tokens=7"])
    assert is_run and config.sampler.max_new_tokens == 7
    assert config.sampler.num_slots == saved["sampler"]["num_slots"]  # the rest is the run's


def test_sizes_the_host_cannot_hold_are_named_before_any_compile(setup, capsys):
    from scalerl_jax.telemetry.compile_events import compile_log

    _, base_dir, jsonl, _ = setup
    compiles = compile_log().count()
    # 2**24 slots of the recipe's 16,384 tokens: petabytes of KV pool on any host.
    status = evaluate.main(["--checkpoint", base_dir, "--data", jsonl, "--config.sampler.num_slots=16777216"])
    err = capsys.readouterr().err
    assert status == 2 and "`sampler.num_slots` = 16777216" in err and "`sampler.max_new_tokens` = 14336" in err
    assert "Traceback" not in err and compile_log().count() == compiles


def test_progress_line_by_hand():
    # 10 of 40 samples (3 of 10 prompts) in 20 s with 500 completion tokens: 25 tokens/s, and 30
    # samples left at 2 s each: ETA 60 s.
    line = benchmark_lib.progress_line(10, 40, 3, 10, 500, 20.0, 4)
    assert line == (
        "evaluate: 10/40 samples, 3/10 prompts done, 25.0 completion tokens/s, 20 s elapsed, ETA 60 s, "
        "4 programs compiled"
    )
    assert "ETA unknown" in benchmark_lib.progress_line(0, 40, 0, 10, 0, 5.0, 0)


GSM8K_TEST = os.path.join(GSM8K_DIR, "test.jsonl")


@pytest.mark.skipif(not os.path.isfile(GSM8K_TEST), reason=f"GSM8K not found at {GSM8K_TEST}")
def test_gsm8k_rows_as_published_with_gold_extraction_and_two_step_problems():
    # GSM8K's test file as published: `question`, and `answer` a worked solution whose gold follows
    # the last `#### `. Rows 0, 1 and 3 are the first of its 326 two-line solutions (counted by a
    # one-line script over the file); their golds read by hand: 18 (Janet's ducks) and 3 (bolts).
    benchmark = benchmark_lib.read_benchmark(
        GSM8K_TEST, problem_field="question", answer_field="answer", gold_extraction="hashes", max_solution_steps=2
    )
    assert len(benchmark.problems) == 326 and benchmark.rows[:3] == [0, 1, 3]
    assert benchmark.answers[:2] == ["18", "3"]
    assert benchmark.problems[0].startswith("Janet’s ducks lay 16 eggs per day.")
    everything = benchmark_lib.read_benchmark(GSM8K_TEST, problem_field="question", gold_extraction="hashes")
    assert len(everything.problems) == 1319 and everything.answers[0] == "18"
