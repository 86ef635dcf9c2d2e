"""A user's mistakes at each entry point, and the one line each gets: one test (or parametrized
group) per class, the fault built here in tmp_path, every entry point run as a subprocess.

The outcome asserted: the exit status (2 for a bad config, flag, data or checkpoint file; 1 for an
output that cannot be written), stderr's last line exactly (naming the file and the row, line or
key, and what was expected), and no traceback (`SCALERL_DEBUG=1` brings it back).
"""

import json
import os
import subprocess
import sys

import pytest
from repo_paths import REPO

TIMEOUT_S = 240

# The tiny recipe on a local jsonl file, without the warm start (the data is built first, before
# the checkpoint is read, so the checkpoint may be a stub).
DATA_RUN_CONFIG = """
from scalerl_jax.config import recipes


def get_config():
    c = recipes.tiny()
    del c["warm_start"], c["synthetic"]
    c.data.dataset = "jsonl"
    c.data.heldout_size = 1
    return c
"""


def cli(module: str, *args: str, debug: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("SCALERL_DEBUG", None)
    if debug:
        env["SCALERL_DEBUG"] = "1"
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def one_line(result: subprocess.CompletedProcess, status: int) -> str:
    """The last line of stderr, after checking the exit status and that no traceback came out."""
    assert result.returncode == status, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stderr.strip().splitlines()[-1]


# Data files a user gives: (file name, bytes, the line that names the problem; {path} is the file).
DATA_FAULTS = {
    "malformed_line": (
        "problems.jsonl",
        b'{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": \n',
        "{path}: row 1 (line 2) is not valid JSON: Expecting value at column 30",
    ),
    "no_answer_field": (
        "problems.jsonl",
        b'{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n',
        "{path}: row 1 has no field 'answer' (fields: ['problem'])",
    ),
    "empty_answer": (
        "problems.jsonl",
        b'{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": " "}\n',
        "{path}: row 1 field 'answer' is empty",
    ),
    "empty_file": ("problems.jsonl", b"", "{path}: the file has no rows"),
    "binary_file": (
        "problems.jsonl",
        b'{"problem": "1+1", "answer": "2"}\n\x89PNG\r\n\x1a\n\x00\xff\xfe',
        "{path}: row 1 (line 2) is not valid UTF-8: 'utf-8' codec can't decode byte 0x89 in position 0: "
        "invalid start byte",
    ),
}
# evaluate takes a non-string answer as str(value) (its docstring); main's reader wants strings.
MAIN_ONLY_FAULTS = {
    "non_string_answer": (
        "problems.jsonl",
        b'{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": 4}\n',
        "{path}: row 1 field 'answer' is int, expected a string",
    ),
    "too_few_rows_for_the_heldout_split": (
        "problems.jsonl",
        b'{"problem": "1+1", "answer": "2"}\n',
        "config key `data.heldout_size` = 1: {path} has 1 distinct problems, so a held-out split of 1 leaves "
        "none to train on; expected a value below 1",
    ),
}


def write_fault(tmp_path, fault) -> str:
    name, content, _ = fault
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


def stub_checkpoint(tmp_path) -> str:
    """A Hugging Face directory whose config.json says what it is and nothing more: the commands
    read it (evaluate: to tell a run from a model) but never reach its weights, as the data error
    comes first."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    return str(model)


@pytest.mark.parametrize("fault", sorted({**DATA_FAULTS, **MAIN_ONLY_FAULTS}))
def test_i1_main_on_a_bad_data_file_names_the_file_and_row(tmp_path, fault):
    spec = {**DATA_FAULTS, **MAIN_ONLY_FAULTS}[fault]
    data = write_fault(tmp_path, spec)
    config = tmp_path / "run_config.py"
    config.write_text(DATA_RUN_CONFIG)
    result = cli(
        "scalerl_jax.main",
        f"--config={config}",
        f"--workdir={tmp_path / 'run'}",
        f"--config.model.checkpoint={stub_checkpoint(tmp_path)}",
        f"--config.data.path={data}",
    )
    assert one_line(result, 2) == "error: " + spec[2].format(path=data)


@pytest.mark.parametrize("fault", sorted(DATA_FAULTS))
def test_i2_evaluate_on_a_bad_data_file_names_the_file_and_row(tmp_path, fault):
    spec = DATA_FAULTS[fault]
    data = write_fault(tmp_path, spec)
    result = cli("scalerl_jax.cli.evaluate", f"--checkpoint={stub_checkpoint(tmp_path)}", f"--data={data}")
    expected = spec[2].format(path=data)
    if fault == "empty_answer":
        expected += "; expected the gold answer"
    assert one_line(result, 2) == "error: " + expected


def test_i2_debug_brings_the_traceback_back(tmp_path):
    data = write_fault(tmp_path, DATA_FAULTS["malformed_line"])
    result = cli("scalerl_jax.cli.evaluate", f"--checkpoint={stub_checkpoint(tmp_path)}", f"--data={data}", debug=True)
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "DataFileError" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {data}: row 1 (line 2)")


CONFIG_FILE_FAULTS = {
    "syntax_error": (
        "def get_config(:\n",
        "{path}: {path}, line 1: invalid syntax (expected a Python file defining get_config())",
    ),
    "missing": (None, "{path}: no such file {path}"),
    "get_config_raises": (
        'import os\n\n\ndef get_config():\n    return os.environ["SCALERL_NO_SUCH_VARIABLE"]\n',
        "{path}: get_config() of {path} raised KeyError: 'SCALERL_NO_SUCH_VARIABLE' (line 5)",
    ),
    "directory": ("dir", "{path}: {path} is a directory; expected a Python file defining get_config()"),
}


@pytest.mark.parametrize("fault", sorted(CONFIG_FILE_FAULTS))
def test_i3_a_config_file_that_is_missing_or_not_python(tmp_path, fault):
    content, expected = CONFIG_FILE_FAULTS[fault]
    path = tmp_path / "my_config.py"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    result = cli("scalerl_jax.main", f"--config={path}", f"--workdir={tmp_path / 'run'}")
    assert one_line(result, 2) == "config error: --config=" + expected.format(path=path)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "flag, expected",
    [
        ("--config.nonexistent=1", "--config.nonexistent: the config of configs/tiny.py has no key `nonexistent`"),
        (
            "--config.rl.objectve=dapo",
            '--config.rl.objectve: the config of configs/tiny.py has no key `rl.objectve`. Did you mean "objective"?',
        ),
        (
            "--config.rl.objective.kind=dapo",
            "--config.rl.objective.kind: the config of configs/tiny.py has no key `rl.objective.kind`",
        ),
        ("--config.optimizer.lr=abc", "--config.optimizer.lr=abc: could not convert string to float: 'abc'"),
    ],
)
def test_i4_an_unknown_config_key_or_a_bad_value_exits_2(tmp_path, flag, expected):
    result = cli("scalerl_jax.main", "--config=configs/tiny.py", flag, f"--workdir={tmp_path / 'run'}")
    assert one_line(result, 2) == "config error: " + expected
    assert not (tmp_path / "run").exists()


def test_i5_main_usage_errors_exit_2(tmp_path):
    result = cli("scalerl_jax.main", "--config=configs/tiny.py")
    assert one_line(result, 2) == (
        "usage error: --workdir=None: Flag --workdir must have a value other than None. (--helpshort lists the flags)"
    )
    result = cli("scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={tmp_path}", "--bogus")
    assert one_line(result, 2) == "usage error: Unknown command line flag 'bogus' (--helpshort lists the flags)"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny random Llama checkpoint with its tokenizer, and a run directory of two checkpoints on it."""
    import policy_fixtures

    root = tmp_path_factory.mktemp("input_faults")
    base_dir, run_dir = str(root / "base"), str(root / "run")
    policy_fixtures.make_random_base(base_dir)
    policy_fixtures.make_run_dir(run_dir, policy_fixtures.run_config(base_dir), step_seeds={1: 1, 2: 2})
    good = root / "good.jsonl"
    good.write_text(json.dumps({"problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    return base_dir, run_dir, str(good)


def copy_base(base_dir, target):
    import shutil

    shutil.copytree(base_dir, target)
    return str(target)


def test_i6_a_truncated_tokenizer_json_is_named(base, tmp_path):
    model = copy_base(base[0], tmp_path / "model")
    tokenizer = os.path.join(model, "tokenizer.json")
    text = open(tokenizer).read()
    with open(tokenizer, "w") as f:
        f.write(text[: len(text) // 2])
    result = cli("scalerl_jax.cli.evaluate", f"--checkpoint={model}", f"--data={base[2]}", "--config=configs/tiny.py")
    line = one_line(result, 2)
    assert line.startswith(f"error: {tokenizer}: not a valid tokenizers file (EOF while parsing"), line


def test_i7_config_json_vocab_size_disagreeing_with_the_weights_is_named(base, tmp_path):
    model = copy_base(base[0], tmp_path / "model")
    config_file = os.path.join(model, "config.json")
    config = json.loads(open(config_file).read())
    vocab = config["vocab_size"]
    config["vocab_size"] = vocab + 7
    with open(config_file, "w") as f:
        json.dump(config, f)
    result = cli("scalerl_jax.cli.evaluate", f"--checkpoint={model}", f"--data={base[2]}", "--config=configs/tiny.py")
    assert one_line(result, 2) == (
        f"error: {model}/model.safetensors: tensor 'model.embed_tokens.weight' has shape ({vocab}, 64), but "
        f"{config_file} gives ({vocab + 7}, 64) (parameter embed_tokens); the weights and config.json disagree"
    )


def test_i8_export_to_a_read_only_directory_exits_1_naming_the_path(base, tmp_path):
    from test_faults import tiny_tmpfs

    with tiny_tmpfs(tmp_path / "mnt", 64) as mount:
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, timeout=10)
        out = mount / "export"
        result = cli("scalerl_jax.cli.export", base[1], f"--out={out}")
        assert one_line(result, 1) == (f"error: cannot write the export to {out}: Read-only file system ({out}.tmp)")


def test_i9_tired_user_inputs_get_one_line(base, tmp_path):
    """The inputs a tired user gives each entry point: a missing file, a directory for a file, a
    wrong suffix, a missing output directory, a run without checkpoints, a step that does not
    exist, an empty study directory, a metrics file that is not text."""
    _, run_dir, good = base
    (tmp_path / "empty").mkdir()
    no_checkpoints = tmp_path / "no_checkpoints"
    no_checkpoints.mkdir()
    (no_checkpoints / "config.json").write_text(open(os.path.join(run_dir, "config.json")).read())
    binary = tmp_path / "metrics.jsonl"
    binary.write_bytes(b'{"step": 1}\n\xff\xfe\n')
    syntax = tmp_path / "syntax.py"
    syntax.write_text("def get_config(:\n")
    raises = tmp_path / "raises.py"
    raises.write_text('import os\n\n\ndef get_config():\n    return os.environ["SCALERL_NO_SUCH_VARIABLE"]\n')
    cases = [
        (
            ("scalerl_jax.cli.evaluate", f"--checkpoint={run_dir}", f"--data={tmp_path / 'nope.jsonl'}"),
            2,
            f"error: --data '{tmp_path / 'nope.jsonl'}' does not exist",
        ),
        (
            ("scalerl_jax.cli.evaluate", f"--checkpoint={run_dir}", f"--data={tmp_path / 'empty'}"),
            2,
            f"error: --data '{tmp_path / 'empty'}' is a directory; expected a .jsonl or .parquet file",
        ),
        (
            ("scalerl_jax.cli.evaluate", f"--checkpoint={run_dir}", f"--data={syntax}"),
            2,
            f"error: --data '{syntax}': unknown suffix '.py' (expected .jsonl or .parquet)",
        ),
        (
            (
                "scalerl_jax.cli.evaluate",
                f"--checkpoint={run_dir}",
                f"--data={good}",
                f"--out={tmp_path / 'no' / 'r.json'}",
            ),
            2,
            f"error: --out '{tmp_path / 'no' / 'r.json'}': the directory '{tmp_path / 'no'}' does not exist",
        ),
        (
            ("scalerl_jax.cli.evaluate", f"--checkpoint={tmp_path / 'empty'}", f"--data={good}"),
            2,
            f"error: '{tmp_path / 'empty'}' has no config.json: neither a run directory nor a Hugging Face checkpoint directory",
        ),
        (
            ("scalerl_jax.cli.evaluate", f"--checkpoint={run_dir}", f"--data={good}", "--step=7"),
            2,
            f"error: run directory '{run_dir}' has no checkpoint at step 7; available steps: [1, 2]",
        ),
        (
            ("scalerl_jax.cli.export", str(no_checkpoints), f"--out={tmp_path / 'o'}"),
            2,
            f"error: run directory '{no_checkpoints}' has no checkpoints under {no_checkpoints}/checkpoints",
        ),
        (
            ("scalerl_jax.cli.export", run_dir, f"--out={tmp_path / 'no' / 'o'}"),
            2,
            f"error: --out '{tmp_path / 'no' / 'o'}': the directory '{tmp_path / 'no'}' does not exist",
        ),
        (
            ("scalerl_jax.cli.study", "--analyze", str(tmp_path / "empty")),
            2,
            f"error: {tmp_path / 'empty'}: no run with an evaluation under <variant>/seed<k>/metrics.jsonl",
        ),
        (
            ("scalerl_jax.cli.study", f"--config={syntax}", f"--workdir={tmp_path / 'study'}"),
            2,
            f"error: --config {syntax}, line 1: invalid syntax (expected a Python file)",
        ),
        (
            ("scalerl_jax.cli.study", f"--config={raises}", f"--workdir={tmp_path / 'study'}"),
            2,
            f"error: --config {raises}: get_config() raised KeyError: 'SCALERL_NO_SUCH_VARIABLE' (line 5)",
        ),
        (
            ("scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={good}"),
            2,
            f"usage error: --workdir={good} is a file; expected a directory",
        ),
        (
            ("scalerl_jax.cli.study", "--analyze", str(tmp_path / "empty"), "--a-range=x"),
            2,
            "error: --a-range must be LO,HI with 0 <= LO <= HI <= 1, got 'x'",
        ),
        (
            ("scalerl_jax.cli.fit", str(tmp_path / "empty")),
            2,
            f"error: {tmp_path / 'empty'}/metrics.jsonl: no such metrics file",
        ),
        (
            ("scalerl_jax.cli.fit", str(binary)),
            2,
            f"error: {binary} line 2: not UTF-8 text (byte 0xff at offset 12); expected JSON lines",
        ),
        (
            (
                "scalerl_jax.main",
                "--config=configs/tiny.py",
                f"--workdir={tmp_path / 'run'}",
                "--config.data.dataset=jsonl",
                f"--config.data.path={tmp_path / 'nope.jsonl'}",
            ),
            2,
            None,
        ),
    ]
    for args, status, expected in cases:
        line = one_line(cli(*args), status)
        if expected is None:  # main: the config checks' message, whose wording is its own
            assert "data.path" in line and str(tmp_path / "nope.jsonl") in line, line
        else:
            assert line == expected, (args, line)


def break_tokenizer_file(model: str) -> str:
    path = os.path.join(model, "tokenizer.json")
    os.remove(path)
    return f"error: {path} does not exist"


def break_config_field(model: str) -> str:
    path = os.path.join(model, "config.json")
    config = json.loads(open(path).read())
    config["num_attention_heads"] = "four"
    with open(path, "w") as f:
        json.dump(config, f)
    return f"error: {path}: field 'num_attention_heads' = 'four'; expected an integer"


@pytest.mark.parametrize("fault", [break_tokenizer_file, break_config_field], ids=["no_tokenizer", "bad_field"])
def test_i10_main_on_a_checkpoint_missing_a_file_or_with_a_bad_field_exits_2(base, tmp_path, fault):
    model = copy_base(base[0], tmp_path / "model")
    expected = fault(model)
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i} + 1", "answer": str(i + 1)}) + "\n" for i in range(4)))
    config = tmp_path / "run_config.py"
    config.write_text(DATA_RUN_CONFIG)
    result = cli(
        "scalerl_jax.main",
        f"--config={config}",
        f"--workdir={tmp_path / 'run'}",
        f"--config.model.checkpoint={model}",
        f"--config.data.path={data}",
    )
    assert one_line(result, 2) == expected


def test_i11_mixture_of_experts_keys_on_a_dense_policy_are_refused_naming_both_keys(base, tmp_path):
    """`rl.router_replay` (and a load-balancing loss) on a dense policy: refused before any work,
    naming the key and the one that chose the policy, for a warm start and for a checkpoint."""
    result = cli(
        "scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={tmp_path / 'a'}", "--config.rl.router_replay=True"
    )
    assert one_line(result, 2) == (
        "config error: config key `rl.router_replay` = True needs a mixture-of-experts policy, but config key "
        "`model.preset` = 'tiny-llama' is a dense one (no experts)"
    )
    assert not (tmp_path / "a" / "warm_start").exists()
    config = tmp_path / "run_config.py"
    config.write_text(DATA_RUN_CONFIG)
    result = cli(
        "scalerl_jax.main",
        f"--config={config}",
        f"--workdir={tmp_path / 'b'}",
        f"--config.model.checkpoint={base[0]}",
        f"--config.data.path={base[2]}",
        "--config.rl.router_replay=True",
        "--config.model.router_aux_loss_coef=0.01",
    )
    assert one_line(result, 2) == (
        "config error: config keys `rl.router_replay` = True and `model.router_aux_loss_coef` = 0.01 need a "
        f"mixture-of-experts policy, but config key `model.checkpoint` = {base[0]!r} is a dense one (no experts)"
    )
