"""`python -m scalerl_jax.cli.evaluate` on a real pretrained model and a real benchmark, as a user runs it.

SmolLM2-135M-Instruct (tests/support/real_models.py) on GSM8K's test file as published (`question`, and a
worked solution whose gold follows the last `####`), with configs/smollm2_gsm8k.py: the answer
styles of an instruct model (`####`, "The answer is", the last number). Each sample's correctness
in the report is checked against an extraction written here from docs/guides/your_model_and_task.md's description of the
styles, on the same completions.
"""

import json
import os
import re
from fractions import Fraction

import pytest
from repo_paths import REPO as ROOT

from scalerl_jax.cli import evaluate

GSM8K_TEST = os.path.join(ROOT, "..", "shared", "data", "gsm8k", "test.jsonl")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def independent_value(text: str) -> Fraction | None:
    """The answer's value: the first number of the line after the last `####`; else of the text
    after the last 'answer is' / 'answer:'; else the last number of the completion."""
    lowered = text.lower()
    for marker in ("####", "answer is", "answer:"):
        cut = lowered.rfind(marker)
        if cut >= 0:
            line = text[cut + len(marker) :].split("\n")[0]
            found = NUMBER.findall(line)
            if found:
                return Fraction(found[0].replace(",", ""))
            if marker == "####":
                return None  # a `####` line without a number: the reward reads no number either
    found = NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(GSM8K_TEST), reason=f"GSM8K not found at {GSM8K_TEST}")
def test_evaluate_smollm2_on_gsm8k_agrees_with_an_independent_extraction(smollm2_dir, tmp_path, capsys):
    rows = [json.loads(line) for line in open(GSM8K_TEST, encoding="utf-8")][:6]
    data = tmp_path / "gsm8k6.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "report.json"
    status = evaluate.main(
        [
            f"--checkpoint={smollm2_dir}",
            f"--data={data}",
            "--config=configs/smollm2_gsm8k.py",
            "--config.data.max_solution_steps=0",
            "--config.sampler.max_new_tokens=96",
            "--config.sampler.num_slots=16",
            "--samples=2",
            "--k=1,2",
            "--completions",
            f"--out={out}",
        ]
    )
    assert status == 0, capsys.readouterr().err[-2000:]
    report = json.loads(out.read_text())
    golds = [Fraction(row["answer"].split("####")[-1].strip().replace(",", "")) for row in rows]
    found = 0
    for entry, gold in zip(report["per_prompt"], golds, strict=True):
        assert entry["answer"].replace(",", "") == str(gold)
        for text, correct in zip(entry["completions"], entry["correct"], strict=True):
            value = independent_value(text)
            found += value is not None
            assert correct == (value == gold), (text, gold)
    assert report["metrics"]["answer_found_frac"] == pytest.approx(found / 12)
    assert report["metrics"]["mean@2"] == pytest.approx(sum(sum(e["correct"]) for e in report["per_prompt"]) / 12)
    assert "wall_seconds" in report and report["wall_seconds"] > 0
