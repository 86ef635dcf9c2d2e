"""`python -m scalerl_jax.cli.export`: a run's checkpoint as a Hugging Face directory that transformers
loads with our logits (the independent reference: transformers' torch Llama), and clear errors."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import policy_fixtures  # noqa: E402
from flax import nnx  # noqa: E402

from scalerl_jax.cli import export  # noqa: E402
from scalerl_jax.config import recipes  # noqa: E402
from scalerl_jax.config.resume import config_json  # noqa: E402
from scalerl_jax.models import Transformer  # noqa: E402
from scalerl_jax.run import export as export_lib  # noqa: E402
from scalerl_jax.run import policy_source, warm_start  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run_dir, base torch model, {step: params}, graphdef, base_dir) with checkpoints at steps 1 and 2."""
    root = tmp_path_factory.mktemp("export")
    base_dir = str(root / "base")
    base_model = policy_fixtures.make_random_base(base_dir)
    config = policy_fixtures.run_config(base_dir)
    run_dir = str(root / "run")
    saved = policy_fixtures.make_run_dir(run_dir, config, step_seeds={1: 1, 2: 2})
    graphdef = nnx.graphdef(
        nnx.eval_shape(lambda: Transformer(policy_source.run_model_config(config, base_dir), rngs=nnx.Rngs(0)))
    )
    return run_dir, base_model, saved, graphdef, base_dir


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.double().numpy()


def test_export_round_trip_matches_transformers(run, tmp_path):
    run_dir, base_model, saved, graphdef, _ = run
    tokens = np.random.RandomState(0).randint(0, base_model.config.vocab_size, (2, 20))
    base_logits = _torch_logits(base_model, tokens)
    for step, out in ((None, tmp_path / "latest"), (1, tmp_path / "step1")):
        assert export.main([run_dir, "--out", str(out)] + ([] if step is None else ["--step", str(step)])) == 0
        exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        ours = nnx.merge(graphdef, saved[step or 2])
        expected = np.asarray(ours(jnp.asarray(tokens)), np.float64)
        actual = _torch_logits(exported, tokens)
        np.testing.assert_allclose(actual, expected, atol=1e-4, rtol=0)
        assert np.abs(actual - base_logits).max() > 1e-2  # the checkpoint's params, not the base's
        with open(out / "scalerl_export.json") as f:
            assert json.load(f)["step"] == (step or 2)
    # The two steps' params differ, so do their exports.
    step1 = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "step1"), dtype=torch.float32)
    latest = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "latest"), dtype=torch.float32)
    assert np.abs(_torch_logits(step1, tokens) - _torch_logits(latest, tokens)).max() > 1e-2


def test_export_tokenizer_and_generation_config_load(run, tmp_path):
    run_dir, base_model, _, _, base_dir = run
    out = tmp_path / "hf"
    export_lib.export_run(run_dir, str(out))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "What is 3 + 4?\nAnswer in \\boxed{}.<think>3+4</think>\\boxed{7}"
    run_tokenizer = tokenizers.Tokenizer.from_file(os.path.join(base_dir, "tokenizer.json"))  # what the run used
    assert (
        hf_tokenizer.encode(text, add_special_tokens=False) == run_tokenizer.encode(text, add_special_tokens=False).ids
    )
    assert hf_tokenizer.eos_token == "</s>" and hf_tokenizer.bos_token == "<s>"
    generation = transformers.GenerationConfig.from_pretrained(str(out))
    assert generation.eos_token_id == base_model.config.eos_token_id
    assert sorted(os.listdir(out)) == sorted(
        [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "scalerl_export.json",
        ]
    )


def test_export_errors_name_the_problem(run, tmp_path, capsys):
    run_dir = run[0]

    def fails(argv, *phrases):
        assert export.main(argv) == 2
        err = capsys.readouterr().err
        for phrase in phrases:
            assert phrase in err, err

    fails([str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "does not exist")
    (tmp_path / "empty_run").mkdir()
    fails([str(tmp_path / "empty_run"), "--out", str(tmp_path / "o")], "has no config.json")
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    shutil.copyfile(os.path.join(run_dir, "config.json"), no_ckpt / "config.json")
    fails([str(no_ckpt), "--out", str(tmp_path / "o")], "has no checkpoints")
    fails([run_dir, "--step", "7", "--out", str(tmp_path / "o")], "no checkpoint at step 7", "[1, 2]")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    fails([run_dir, "--out", str(busy)], "not empty", "--overwrite")
    assert (busy / "keep.txt").exists()
    assert export.main([run_dir, "--out", str(busy), "--overwrite"]) == 0
    assert not (busy / "keep.txt").exists() and (busy / "model.safetensors").exists()
    assert not os.path.exists(str(tmp_path / "o"))


def test_warm_start_base_is_found_after_the_json_round_trip(tmp_path):
    """A run's config.json (tuples become lists) points at the same warm-start digest as the config."""
    config = recipes.tiny()
    expected = warm_start.checkpoint_dir(config, str(tmp_path))
    os.makedirs(expected)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config_json(config), f)
    loaded = policy_source.load_run_config(str(tmp_path))
    assert policy_source.base_checkpoint_dir(loaded, str(tmp_path)) == expected
