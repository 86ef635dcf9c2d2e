"""`scalerl COMMAND`: one console command for every entry point."""

import importlib
import pathlib
import subprocess
import sys
import tomllib

from repo_paths import REPO

from scalerl_jax.cli.__main__ import COMMANDS, main

ROOT = pathlib.Path(REPO)


def test_the_console_script_is_the_dispatcher():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"scalerl": "scalerl_jax.cli.__main__:main"}


def test_every_command_module_of_the_cli_package_is_a_command():
    """Each module under scalerl_jax/cli/ with a `main` is reachable as `scalerl NAME`."""
    modules = {
        path.stem
        for path in (ROOT / "scalerl_jax" / "cli").glob("*.py")
        if not path.stem.startswith("_") and hasattr(importlib.import_module(f"scalerl_jax.cli.{path.stem}"), "main")
    }
    assert modules == {module for module, _ in COMMANDS.values()}


def test_no_command_and_an_unknown_command_print_the_usage_and_exit_2(capsys):
    assert main([]) == 2
    assert "compile-check" in capsys.readouterr().out
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage error: unknown command 'trian'") and "plan-memory" in err


def test_help_lists_the_commands_and_exits_0(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_a_command_gets_the_rest_of_the_command_line(tmp_path, capsys):
    """`scalerl fit FILE` is `python -m scalerl_jax.cli.fit FILE`: a missing metrics file is one
    line and status 2."""
    assert main(["fit", str(tmp_path / "missing.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'missing.jsonl'}: no such metrics file"


def test_train_runs_the_absl_job():
    """`python -m scalerl_jax.cli train` without --workdir stops at absl's flag check with one line
    and status 2, as `python -m scalerl_jax.main` does (a subprocess: absl's flags are global)."""
    result = subprocess.run(
        [sys.executable, "-m", "scalerl_jax.cli", "train", "--config=configs/tiny.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "--workdir" in result.stderr.strip().splitlines()[-1]
