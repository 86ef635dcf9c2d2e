"""The main job on checkpoints as their makers ship them: a tiny Llama-3.1 and a tiny Qwen2.5.

Each checkpoint (tests/support/family_checkpoints.py) has random weights saved by transformers, a
tokenizer that carries the family's real special tokens and chat template, and the family's
generation_config.json eos list. The 8B recipe runs on it for 2 steps with the `plain` answer
format (a base model without a think phase), from the command line as a person runs it. The
references are transformers' own chat-template rendering and the family's eos ids as named in
its files (not our loader's output).
"""

import json
import os
import subprocess
import sys

import pytest
from repo_paths import REPO

transformers = pytest.importorskip("transformers")

from family_checkpoints import EXPECTED, make_family_checkpoint  # noqa: E402

PROBLEMS = [
    (f"What is {a} + {b}?", str(a + b))
    for a, b in ((12, 30), (7, 8), (100, 23), (4, 4), (55, 45), (9, 91), (31, 2), (60, 6))
]
TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."
OVERRIDES = {
    "model.dtype": "float32",
    "model.logprob_chunk": 64,
    "data.dataset": "jsonl",
    "data.heldout_size": 4,
    "data.max_prompt_tokens": 192,
    "data.answer_format": "plain",
    "data.prompt_template": TEMPLATE,
    "data.verify_workers": 1,
    "batch.prompts_per_step": 2,
    "batch.generations_per_prompt": 2,
    "batch.microbatches": 1,
    "sampler.num_slots": 8,
    "sampler.chunk_steps": 8,
    "sampler.max_new_tokens": 48,
    "sampler.think_budget_min": 32,
    "sampler.think_budget_max": 40,
    "sampler.answer_budget": 8,
    "schedule.k": 1,
    "num_steps": 2,
    "optimizer.warmup_steps": 1,
    "eval.every": 2,
    "eval.num_prompts": 4,
    "eval.samples_per_prompt": 8,
    "eval.samples_logged": 4,
    "checkpoint.every": 2,
    "mesh.require_accelerator": False,
    "mesh.cpu_devices": 2,
}


def run_family(tmp_path, family: str):
    checkpoint = make_family_checkpoint(family, str(tmp_path / "model"))
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in PROBLEMS))
    workdir = tmp_path / "run"
    overrides = {**OVERRIDES, "model.checkpoint": checkpoint, "data.path": str(data)}
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "scalerl_jax.main",
            "--config=configs/scalerl_8b.py",
            f"--workdir={workdir}",
            *[f"--config.{k}={v}" for k, v in overrides.items()],
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return checkpoint, workdir, result


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("family", ["llama3.1", "qwen2.5"])
def test_main_runs_the_8b_recipe_on_a_shipped_checkpoint(tmp_path, family):
    checkpoint, workdir, result = run_family(tmp_path, family)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [row["step"] for row in read_jsonl(workdir / "metrics.jsonl")] == [0, 1, 2]

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    stop_ids = {tokenizer.convert_tokens_to_ids(name) for name in EXPECTED[family]["generation_eos"]}
    samples = read_jsonl(workdir / "samples.jsonl")
    assert {s["step"] for s in samples} == {0, 2} and {s["set"] for s in samples} == {"eval"}
    for sample in samples:  # prompts rendered exactly as transformers renders them
        problem = sample["prompt"]
        messages = [
            {
                "role": "user",
                "content": next(
                    TEMPLATE.replace("{problem}", p) for p, _ in PROBLEMS if TEMPLATE.replace("{problem}", p) in problem
                ),
            }
        ]
        assert problem == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    stopped = [s for s in samples if s["finish_reason"] == "stop"]
    assert stopped and all(s["last_token"] in stop_ids for s in stopped)  # the family's eos ids end generation
    eos_id = tokenizer.convert_tokens_to_ids(EXPECTED[family]["eos"])
    assert any(s["last_token"] != eos_id for s in stopped)  # generation_config.json's other eos ids too
    assert all(s["finish_reason"] == "length" and s["num_tokens"] == 48 for s in samples if s not in stopped)
    assert "interrupted 0.00" in result.stderr  # plain format: no forced interruption


def test_extra_eval_sets_are_loaded_under_their_names(tmp_path):
    from scalerl_jax.config import recipes
    from scalerl_jax.models import load_checkpoint_tokenizer
    from scalerl_jax.run import sampling_setup
    from scalerl_jax.run.build import load_task

    checkpoint = make_family_checkpoint("qwen2.5", str(tmp_path / "model"))
    data, aime = tmp_path / "problems.jsonl", tmp_path / "aime.jsonl"
    data.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in PROBLEMS))
    aime.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in PROBLEMS[:3]))
    config = recipes.scalerl_8b()
    config.update_from_flattened_dict(
        {
            **{k: v for k, v in OVERRIDES.items() if not k.startswith("mesh.")},
            "model.checkpoint": checkpoint,
            "data.path": str(data),
        }
    )
    config.eval.extra = {"aime24": str(aime)}
    tokens = load_checkpoint_tokenizer(checkpoint)
    task = load_task(config, str(tmp_path / "run"), sampling_setup.make_prompt_encoder(config, tokens, checkpoint))
    assert [s.name for s in task.eval_sets] == ["eval", "eval_aime24"]  # metric prefixes
    extra = task.eval_sets[1]
    assert extra.golds == [a for _, a in PROBLEMS[:3]] and extra.problems == [p for p, _ in PROBLEMS[:3]]
    assert len(task.eval_sets[0].prompts) == 4 and len(task.train_prompts) == 4  # heldout_size 4 of 8


def test_the_ladders_transfer_rungs_are_a_second_evaluation_set_labelled_by_level(tmp_path):
    from scalerl_jax.config import recipes
    from scalerl_jax.config.adapters import ladder_config
    from scalerl_jax.data.ladder import generate_splits
    from scalerl_jax.models import load_checkpoint_tokenizer
    from scalerl_jax.run import sampling_setup
    from scalerl_jax.run.build import load_task

    checkpoint = make_family_checkpoint("qwen2.5", str(tmp_path / "model"))
    config = recipes.smollm2_arith()
    config.model.checkpoint = checkpoint
    config.ladder.heldout_per_level = 4
    config.data.max_prompt_tokens = 1024  # the test checkpoint's tokenizer makes every prompt longer than 96
    tokens = load_checkpoint_tokenizer(checkpoint)
    task = load_task(config, str(tmp_path / "run"), sampling_setup.make_prompt_encoder(config, tokens, checkpoint))
    assert [s.name for s in task.eval_sets] == ["eval", "eval_transfer"]
    heldout, transfer = task.eval_sets
    assert sorted(heldout.labels or []) == sorted(["add_1d", "sub_1d", "mul_1d", "add_teen"] * 4)
    assert sorted(transfer.labels or []) == sorted(["add_2d", "mul_add"] * 4)
    splits = generate_splits(ladder_config(config))
    assert sorted(task.train_problems) == sorted(p.text for p in splits["train"])
    assert not set(task.train_problems) & set(heldout.problems)
