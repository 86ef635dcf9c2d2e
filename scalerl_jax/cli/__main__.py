"""`scalerl COMMAND [ARGS]`: one console command for every entry point (`python -m scalerl_jax.cli`).

Each command's module is imported only when chosen: the RL job's flags are absl's, the others'
argparse's, and JAX starts only for commands that need it.
"""

from __future__ import annotations

import importlib
import sys

# command -> (module under scalerl_jax.cli, one line of help)
COMMANDS = {
    "train": ("train", "the RL run (= python -m scalerl_jax.main)"),
    "evaluate": ("evaluate", "pass rates of a checkpoint or run on a data file"),
    "merge-evals": ("merge_evals", "one report from the reports of an evaluation run in parts"),
    "ladder": ("ladder", "the arithmetic ladder of a config as jsonl files"),
    "export": ("export", "a run's policy as a Hugging Face checkpoint directory"),
    "fit": ("fit", "sigmoid and power-law fits of runs' pass rate against compute"),
    "study": ("study", "recipe variants x seeds as runs, and their analysis"),
    "verify-code": ("verify_code", "one program against its tests in the code sandbox, as a JSON line"),
    "eval-noise": ("eval_noise", "how much of a study's scatter is evaluation noise"),
    "compile-check": ("compile_check", "compile every program of a run for GPU or TPU topologies"),
    "plan-memory": ("plan_memory", "per-device memory of the train step and the KV cache"),
    "config-docs": ("config_docs", "the reference of every config key (docs/config.md)"),
}
EXIT_USAGE = 2


def usage() -> str:
    """The list of commands."""
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "usage: scalerl COMMAND [ARGS] (COMMAND --help for its flags)\n\ncommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the chosen command with the rest of the command line; 2 with the usage on a bad one."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else EXIT_USAGE
    if argv[0] not in COMMANDS:
        print(f"usage error: unknown command {argv[0]!r}\n{usage()}", file=sys.stderr)
        return EXIT_USAGE
    module = importlib.import_module(f"scalerl_jax.cli.{COMMANDS[argv[0]][0]}")
    sys.argv = [f"scalerl {argv[0]}", *argv[1:]]
    if argv[0] == "train":
        module.cli()  # absl's app.run reads sys.argv and exits itself
        return 0
    status = module.main(argv[1:])
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
