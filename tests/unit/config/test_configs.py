"""Every recipe variant loads and validates; bad configs fail naming the key."""

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from repo_paths import REPO

from scalerl_jax.config import recipes
from scalerl_jax.config.devices import check_devices
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.resume import check_resume, config_json
from scalerl_jax.config.validation import validate
from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.train import OptimizerConfig, create_train_state, make_optimizer

CONFIG_DIR = os.path.join(REPO, "configs")


def load_config_file(name: str, arg: str | None = None):
    spec = importlib.util.spec_from_file_location(name, os.path.join(CONFIG_DIR, name))
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg) if arg is not None else module.get_config()


ALL_8B = (
    [("scalerl_8b.py", None)]
    + [("loo.py", v) for v in recipes.LEAVE_ONE_OUT]
    + [("prevalent.py", v) for v in recipes.PREVALENT]
    + [("scale.py", v) for v in recipes.SCALE]
)


@pytest.mark.parametrize("name,arg", ALL_8B)
def test_every_8b_config_validates(name, arg):
    config = load_config_file(name, arg)
    validate(config, num_devices=80, check_files=False)


def abstract_train_state(config):
    """The config's policy and optimizer state as shapes only (`nnx.eval_shape`, `jax.eval_shape`)."""
    model_config = get_preset(
        config.model.preset,
        dtype=config.model.dtype,
        fp32_head=config.model.fp32_head,
        scan_layers=config.model.scan_layers,
        remat_policy=config.model.remat_policy,
    )
    model = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
    _, params = nnx.split(model)
    optimizer = make_optimizer(
        OptimizerConfig(
            learning_rate=config.optimizer.lr,
            warmup_steps=config.optimizer.warmup_steps,
            eps=config.optimizer.eps,
            weight_decay=config.optimizer.weight_decay,
            max_grad_norm=config.optimizer.max_grad_norm or None,
        )
    )
    return jax.eval_shape(lambda p: create_train_state(p, optimizer), params)


@pytest.mark.parametrize("name,arg", ALL_8B)
def test_every_8b_config_builds_abstractly(name, arg):
    config = load_config_file(name, arg)
    state = abstract_train_state(config)
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    assert num_params == 8_030_261_248  # meta-llama/Llama-3.1-8B (safetensors metadata)
    head = 128_256 * 4_096  # untied unembedding
    float_bytes = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)
    )
    # Hand count: bf16 body (2 B/param), head 4 B with the FP32 head else 2 B; fp32 master, Adam mu and nu
    # (12 B/param) -> 14 N + 2 H with the FP32 head, 14 N without.
    expected = 14 * num_params + (2 * head if config.model.fp32_head else 0)
    assert float_bytes == expected


def test_the_scout_config_runs_on_nine_h100_nodes_with_the_period_scanned_policy():
    """configs/scalerl_scout.py: 72 devices split 8 generating / 64 training (fsdp 16 x tensor 4, the
    16 rows of a microbatch over fsdp), its ':v5p' layout 64 chips split 32 / 32; the policy is Llama
    4 Scout's text decoder, 4 stacks of 12
    layers (3 chunked RoPE layers then 1 NoPE), with the parameter count of its config by hand."""
    config = load_config_file("scalerl_scout.py")
    validate(config, num_devices=72, check_files=False)
    assert check_devices(config, 72) == (8, 64)
    on_v5p = load_config_file("scalerl_scout.py", "v5p")  # 64 chips: 32 generate, 32 train (fsdp 16 x tensor 2)
    validate(on_v5p, num_devices=64, check_files=False)
    assert check_devices(on_v5p, 64) == (32, 32)
    with pytest.raises(ValueError, match="unknown Scout layout 'h200'"):
        load_config_file("scalerl_scout.py", "h200")
    state = abstract_train_state(config)
    stacks = state.params["layers"]
    assert [stacks[j]["attn"]["q_proj"].shape for j in range(4)] == [(12, 5120, 40, 128)] * 4
    assert stacks[0]["moe"]["gate_proj"].shape == (12, 16, 5120, 8192)
    d, heads, kv, hd, experts, width, vocab, layers = 5120, 40, 8, 128, 16, 8192, 202_048, 48
    attention = 2 * d * heads * hd + 2 * d * kv * hd
    layer = attention + 2 * d + d * experts + experts * 3 * d * width + 3 * d * width  # + router, experts, shared
    hand = layers * layer + 2 * vocab * d + d  # untied embedding and head, final norm
    assert hand == 107_769_861_120
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params)) == hand


def test_leave_one_out_changes_exactly_one_choice():
    base = recipes.scalerl_8b()
    assert recipes.leave_one_out("dapo").rl.objective == "dapo" and base.rl.objective == "cispo"
    assert recipes.leave_one_out("no_fp32_head").model.fp32_head is False
    assert recipes.leave_one_out("ppo_off_policy").schedule.kind == "ppo_off_policy"
    changed = recipes.leave_one_out("prompt_norm")
    assert changed.rl.advantage_normalization == "prompt"
    changed.rl.advantage_normalization = "batch"
    assert changed.to_dict() == base.to_dict()


def test_scale_variants_keep_the_paper_batch_sizes():
    # Hand arithmetic: 768 = 48 x 16; bs2048 = 128 x 16; gens8 keeps 768 completions = 96 x 8.
    c = recipes.scale("bs2048")
    assert (c.batch.prompts_per_step, c.batch.generations_per_prompt) == (128, 16)
    c = recipes.scale("bs512")
    assert (c.batch.prompts_per_step, c.batch.generations_per_prompt) == (32, 16)
    for name, (prompts, gens) in {"gens8": (96, 8), "gens24": (32, 24), "gens32": (24, 32)}.items():
        c = recipes.scale(name)
        assert (c.batch.prompts_per_step, c.batch.generations_per_prompt) == (prompts, gens)


def test_paper_split_is_64_generators_16_trainers():
    assert check_devices(recipes.scalerl_8b(), 80) == (64, 16)


def test_device_counts_of_small_splits():
    # tiny: generator_fraction 0.5, one microbatch of 128 rows (hand values from recipes.tiny).
    assert check_devices(recipes.tiny(), 1) == (1, 1)  # one device: both roles share it
    assert check_devices(recipes.tiny(), 2) == (1, 1)
    assert check_devices(recipes.tiny(), 3) == (2, 1)  # round(1.5) = 2 generators
    assert check_devices(recipes.tiny(), 4) == (2, 2)


def test_unknown_key_is_named():
    config = recipes.scalerl_8b()
    config.rl.objectve = "cispo"
    with pytest.raises(ConfigError, match="rl.objectve"):
        validate(config, check_files=False)


def test_bad_fit_range_is_named():
    config = recipes.tiny()
    config.eval.fit_a_range = (0.8, 0.45)
    with pytest.raises(ConfigError, match="eval.fit_a_range"):
        validate(config, check_files=False)


def test_bad_choice_is_named():
    config = recipes.scalerl_8b()
    config.rl.aggregation = "mean"
    with pytest.raises(ConfigError, match="rl.aggregation"):
        validate(config, check_files=False)


# key -> (a value outside its choices, the choices written by hand from the modules that interpret it)
BAD_CHOICES = {
    "rl.objective": ("ppo", ("cispo", "dapo", "grpo", "gspo")),
    "rl.advantage_normalization": ("group", ("batch", "prompt", "none")),
    "rl.length_control": ("truncate", ("interruption", "length_penalty", "none")),
    "schedule.kind": ("sync", ("pipeline", "ppo_off_policy")),
    "data.dataset": ("gsm8k", ("", "polaris_53k", "synthetic", "ladder", "jsonl")),
    "data.answer_format": ("xml", ("think", "plain")),
    "model.dtype": ("float16", ("float32", "bfloat16")),
    "model.remat_policy": ("everything", ("none", "full", "dots", "dots_with_no_batch_dims", "save_qkv_attn")),
    "nan_policy": ("ignore", ("skip", "stop")),
    "logging.wandb_mode": ("cloud", ("offline", "online", "disabled")),
}


@pytest.mark.parametrize("key", sorted(BAD_CHOICES))
def test_a_value_outside_the_choices_is_named_with_them(key):
    bad, allowed = BAD_CHOICES[key]
    config = recipes.tiny()
    section, _, name = key.rpartition(".")
    (config[section] if section else config)[name] = bad
    with pytest.raises(ConfigError) as error:
        validate(config, check_files=False)
    assert str(error.value) == f"config key `{key}` = {bad!r}; expected one of {allowed!r}"


def test_every_remat_policy_validates():
    for policy in ("none", "full", "dots", "dots_with_no_batch_dims", "save_qkv_attn"):
        config = recipes.tiny()
        config.model.remat_policy = policy
        validate(config, check_files=False)


def test_batch_that_does_not_divide_trainers_is_named():
    config = recipes.scalerl_8b()
    config.batch.microbatches = 16  # 768 rows / 16 = 48 rows per microbatch
    # 25 devices x 0.8 -> 20 generators, 5 trainers; 48 % 5 != 0 (hand arithmetic).
    with pytest.raises(ConfigError, match="5 trainer devices"):
        validate(config, num_devices=25, check_files=False)
    validate(config, num_devices=20, check_files=False)  # 16 generators, 4 trainers: 48 % 4 == 0


def test_rows_divide_over_the_trainers_batch_axes_not_their_tensor_axis():
    """16 rows per microbatch on 64 trainers: (1, 64, 1) splits rows 64 ways and is refused; (1, 16, 4)
    splits them over data x fsdp = 16 (tensor 4 sees the same rows) and runs."""
    config = recipes.scalerl_8b()
    config.mesh.generator_fraction = 0.2  # 80 devices: 16 generate, 64 train
    with pytest.raises(ConfigError, match="over the 64 batch devices"):
        validate(config, num_devices=80, check_files=False)
    config.mesh.trainer_shape = (1, -1, 4)
    validate(config, num_devices=80, check_files=False)


def test_missing_dataset_path_is_named(tmp_path):
    config = recipes.scalerl_8b()
    config.data.path = str(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match="data.path"):
        validate(config)


def test_missing_checkpoint_is_named(tmp_path):
    config = recipes.scalerl_8b()
    data = tmp_path / "polaris.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2", "difficulty": 1}\n')
    config.data.path = str(data)
    config.model.checkpoint = str(tmp_path / "missing_model")
    with pytest.raises(ConfigError, match="model.checkpoint"):
        validate(config)


def test_resume_with_a_different_config_names_the_changed_keys(tmp_path):
    config = recipes.tiny()
    (tmp_path / "checkpoints" / "20").mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(config_json(config)))
    config.num_steps = 300  # extending a run is allowed
    check_resume(config, str(tmp_path))
    config.optimizer.lr = 1e-4
    with pytest.raises(ConfigError, match=r"`optimizer.lr` \(5e-05 -> 0.0001\)"):
        check_resume(config, str(tmp_path))
    check_resume(config, str(tmp_path / "fresh"))  # no checkpoints there: a new run


ALL_CONFIGS = ALL_8B + [("tiny.py", None)]
# Hand-written renderings of "What is 1+1?" with each family of templates: literal LaTeX braces.
EXPECTED_PROMPTS = {
    "8b": "What is 1+1?\n\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "tiny": "What is 1+1?\nAnswer in \\boxed{}.",
}


@pytest.mark.parametrize("name,arg", ALL_CONFIGS)
def test_every_config_renders_its_prompt_with_an_empty_box(name, arg):
    from scalerl_jax.data import format_problem

    config = load_config_file(name, arg)
    expected = EXPECTED_PROMPTS["tiny" if name == "tiny.py" else "8b"]
    assert format_problem("What is 1+1?", config.data.prompt_template) == expected


def test_ordered_budgets_are_checked():
    config = recipes.tiny()
    config.sampler.think_budget_min = 70  # tiny: think_budget_max 68 (hand value from recipes.tiny)
    with pytest.raises(ConfigError, match="think_budget_min"):
        validate(config, check_files=False)


def test_resume_without_config_json_uses_the_checkpoint_fingerprint(tmp_path):
    from scalerl_jax.config.resume import flat_config

    config = recipes.tiny()
    (tmp_path / "checkpoints" / "20").mkdir(parents=True)
    fingerprint = flat_config(config)
    check_resume(config, str(tmp_path), saved_fingerprint=fingerprint)  # same config: resumes
    config.rl.objective = "dapo"
    with pytest.raises(ConfigError, match=r"`rl.objective` \('cispo' -> 'dapo'\)"):
        check_resume(config, str(tmp_path), saved_fingerprint=fingerprint)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"`rl.objective`"):
        check_resume(config, str(tmp_path), saved_fingerprint=fingerprint)
    with pytest.raises(ConfigError, match="malformed"):
        check_resume(config, str(tmp_path), saved_fingerprint=None)


def test_think_budgets_are_checked_only_where_interruption_applies():
    # The recipe's budgets (10,240 / 12,288 / 2,048) exceed a 512-token completion: a problem under
    # forced interruption, irrelevant under the plain answer format or without interruption.
    config = recipes.scalerl_8b()
    config.sampler.max_new_tokens = 512
    with pytest.raises(ConfigError, match="think_budget_min") as error:
        validate(config, check_files=False)
    assert "answer_budget" in str(error.value)
    config.data.answer_format = "plain"
    config.rl.length_control = "none"
    assert validate(config, check_files=False) == []
    config.data.answer_format, config.rl.length_control = "think", "length_penalty"
    validate(config, check_files=False)


def test_data_path_alone_selects_the_reader(tmp_path):
    from scalerl_jax.config.validation import check_paths
    from scalerl_jax.data.builders import dataset_kind

    assert recipes.scalerl_8b().data.dataset == ""
    assert dataset_kind("", "/data/polaris-data-53K.jsonl") == "polaris_53k"
    assert dataset_kind("", "/data/gsm8k/test.jsonl") == "jsonl"
    assert dataset_kind("", "/data/rows.parquet") == "jsonl"
    assert [dataset_kind(d, "/x/my.jsonl") for d in ("jsonl", "polaris_53k", "synthetic")] == [
        "jsonl",
        "polaris_53k",
        "synthetic",
    ]
    data = tmp_path / "my.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    config = recipes.scalerl_8b()
    config.data.path = str(data)
    assert not [p for p in check_paths(config) if "data." in p]
    config.data.dataset = "polaris_53k"  # explicit: reads only a file named polaris-data-53K.jsonl
    (problem,) = [p for p in check_paths(config) if "data." in p]
    assert "`data.dataset` = 'polaris_53k'" in problem and str(data) in problem
    config.data.dataset, config.data.path = "", ""
    (problem,) = [p for p in check_paths(config) if "data." in p]
    assert problem.startswith("config key `data.path` = ''")


# SmolLM2-135M's shapes (its config.json): 30 layers, 3 KV heads of 64, hidden 576, MLP 1536,
# 9 heads, 49,152 tokens, tied embeddings.
def smollm2_shapes(dtype: str):
    from scalerl_jax.models.config import ModelConfig

    return ModelConfig(
        family="llama",
        vocab_size=49_152,
        hidden_size=576,
        intermediate_size=1_536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        tie_word_embeddings=True,
        dtype=dtype,
    )


def test_recipe_sampler_that_cannot_fit_is_named_with_its_keys():
    from scalerl_jax.config.memory_fit import check_memory, memory_need

    model = smollm2_shapes("float32")
    config = recipes.scalerl_8b()
    config.model.dtype = "float32"
    need = memory_need(config, model, generator_groups=1, trainer_shape=None, platform="cpu")
    # By hand: K and V of a token = 2 x 30 layers x 3 heads x 64 x 4 B = 46,080 B; every one of 256
    # slots holds 2,048 + 14,336 = 16,384 tokens (1,024 pages of 16).
    assert need.kv_per_token == 46_080 and need.pages == 256 * 1_024
    assert need.kv_cache == 256 * 16_384 * 46_080
    # Params: embedding 49,152 x 576 (tied) + 30 x (q, o 576^2; k, v 576 x 192; 3 MLP 576 x 1,536;
    # 2 norms 576) + the final norm, 4 B each.
    params = 49_152 * 576 + 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1_536 + 2 * 576) + 576
    assert need.weights == 4 * params and need.trainer == 0
    with pytest.raises(ConfigError) as error:
        check_memory(config, need, devices=1, capacity=24 * 10**9, where="host")
    message = str(error.value)
    for text in ("`sampler.num_slots` = 256", "`data.max_prompt_tokens` = 2048", "`sampler.max_new_tokens` = 14336"):
        assert text in message, message
    assert "`model.dtype` = 'float32'" in message and "193.3 GB" in message and "24.0 GB" in message
    # 8 slots of 256 + 512 tokens: 8 x 768 x 46,080 B = 0.28 GB of KV + 0.54 GB of weights fit.
    config.sampler.num_slots, config.data.max_prompt_tokens, config.sampler.max_new_tokens = 8, 256, 512
    small = memory_need(config, model, generator_groups=1, trainer_shape=None, platform="cpu")
    assert small.kv_cache == 8 * 768 * 46_080
    check_memory(config, small, devices=1, capacity=24 * 10**9, where="host")
    # The trainer's share (main on one device) is added and named.
    with_trainer = memory_need(config, model, generator_groups=1, trainer_shape=(1, 1, 1), platform="cpu")
    assert with_trainer.trainer > 3 * 4 * params  # AdamW's mu and nu and the fp32 gradient accumulator at least
    with pytest.raises(ConfigError, match="batch.prompts_per_step"):
        check_memory(config, with_trainer, devices=1, capacity=with_trainer.total, where="host")


def test_config_overrides_apply_without_a_config_file():
    from scalerl_jax.config.argv import CONFIG_ARGV_ERRORS, apply_config_overrides, config_argv_problem

    base = recipes.scalerl_8b()
    argv = ["evaluate", "--config.data.answer_format=plain", "--config.sampler.num_slots=8"]
    config = apply_config_overrides(base, argv)
    assert (config.data.answer_format, config.sampler.num_slots) == ("plain", 8)
    assert (base.data.answer_format, base.sampler.num_slots) == ("think", 256)  # the base is not changed
    for bad, phrase in (
        ("--config.data.answer_formt=plain", 'no key `data.answer_formt`. Did you mean "answer_format"?'),
        ("--config.sampler.num_slots=many", "--config.sampler.num_slots=many"),
    ):
        with pytest.raises(CONFIG_ARGV_ERRORS) as error:
            apply_config_overrides(base, ["evaluate", bad])
        assert phrase in config_argv_problem(["evaluate", bad], error.value, base=base)


def test_smollm2_gsm8k_config_validates_without_warnings_and_asks_for_what_it_reads():
    config = load_config_file("smollm2_gsm8k.py", None)
    config.model.checkpoint, config.data.path = "/models/smollm2", "/data/gsm8k/train.jsonl"
    assert validate(config, check_files=False) == []
    prompt = "What is 1+1?\n\nSolve the problem step by step. Then write the final answer, a number only, on its own last line in the form:\n#### <number>"
    assert format_problem_of(config, "What is 1+1?") == prompt
    assert config.data.answer_extraction.split(",")[0] == "hashes" and config.data.gold_extraction == "hashes"
    config.data.path = "/data/polaris-data-53K.jsonl"  # the Polaris reader does not narrow by solution steps
    with pytest.raises(ConfigError, match="data.max_solution_steps"):
        validate(config, check_files=False)


def format_problem_of(config, problem: str) -> str:
    from scalerl_jax.data import format_problem

    return format_problem(problem, config.data.prompt_template)


def test_smollm2_arith_config_validates_without_warnings_and_names_a_bad_ladder():
    config = load_config_file("smollm2_arith.py", None)
    config.model.checkpoint = "/models/smollm2"
    assert validate(config, check_files=False) == []
    assert format_problem_of(config, "What is 6 + 3?") == "What is 6 + 3? Put the final answer after '####'."
    config.ladder.levels = ("add_1d", "add_9d")
    with pytest.raises(ConfigError, match=r"config key `ladder.levels` = \('add_1d', 'add_9d'\): unknown level"):
        validate(config, check_files=False)
    config = load_config_file("smollm2_arith.py", None)
    config.data.path = "/data/gsm8k/train.jsonl"  # the ladder is generated: a file would be ignored
    with pytest.raises(ConfigError, match="config key `data.path` = '/data/gsm8k/train.jsonl' is not used"):
        validate(config, check_files=False)
    config = recipes.scalerl_8b()
    config.data.dataset = "ladder"
    with pytest.raises(ConfigError, match="`data.dataset` = 'ladder' needs a `ladder` section"):
        validate(config, check_files=False)


def test_math_code_configs_validate_and_draw_both_domains():
    tiny = load_config_file("tiny_math_code.py")
    validate(tiny, check_files=False)
    assert dict(tiny.data.mixture) == {"math": 1.0, "code": 1.0} and tiny.code.task == "puzzles"
    big = load_config_file("scalerl_8b_math_code.py")
    validate(big, num_devices=80, check_files=False)
    assert dict(big.data.mixture) == {"math": 1.0, "code": 1.0} and big.code.task == "file"


def test_a_bad_mixture_is_named_line_by_line(tmp_path):
    config = recipes.tiny_math_code()
    config.data.mixture = {"math": 1.0, "cod": 1.0}
    with pytest.raises(ConfigError) as error:
        validate(config, check_files=False)
    message = str(error.value)
    assert "`data.mixture.cod`: no such domain; the domains are math, code" in message
    assert "the `code` section is set but `data.mixture` has no `code` weight" in message
    config = recipes.tiny()
    config.data.mixture = {"math": 1.0, "code": -2.0}
    with pytest.raises(ConfigError) as error:
        validate(config, check_files=False)
    assert "`data.mixture.code` = -2.0; expected a weight > 0" in str(error.value)
    assert "`data.mixture` has a 'code' weight but the config no `code` section" in str(error.value)


def test_a_missing_code_file_and_bad_puzzle_levels_are_named(tmp_path):
    config = recipes.scalerl_8b_math_code()
    config.code.path = str(tmp_path / "mbpp.jsonl")
    with pytest.raises(ConfigError, match=r"`code.path` = '.*mbpp.jsonl': set it to a local MBPP"):
        validate(config)
    config = recipes.tiny_math_code()
    config.code.levels = ((5, 9),)
    with pytest.raises(
        ConfigError, match=r"`code.levels` = \(\(5, 9\),\), `code.operators`: code puzzles: level \(5, 9\) needs"
    ):
        validate(config, check_files=False)
