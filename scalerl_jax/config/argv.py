"""`--config=FILE [--config.KEY=VALUE ...]` parsed outside `main`, the way `main` parses it, and
one line for each way such a command line can be wrong (`config_argv_problem`)."""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Mapping, Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

# What the parser raises on bad input: absl's flag errors (a value of the wrong type among them),
# KeyError or AttributeError for a key the config does not have, SyntaxError for a config file
# that is not Python, OSError for one that cannot be read (ml_collections raises it lazily, when
# the config is first touched: `touch_config`).
CONFIG_ARGV_ERRORS = (flags.Error, ValueError, TypeError, KeyError, AttributeError, SyntaxError, OSError)
# ml_collections' words for an error raised inside the config file's get_config().
CONFIG_CODE_ERROR = "Error whilst parsing config file"


def parse_config_argv(argv: Sequence[str]) -> ml_collections.ConfigDict | None:
    """The config that `argv` (program name first) names: the file of `--config=FILE`, then each
    `--config.KEY=VALUE` applied in order, and the result locked (no new keys), as `main`'s
    `config_flags.DEFINE_config_file(..., lock_config=True)` does; None without `--config=FILE`.
    Raises one of `CONFIG_ARGV_ERRORS` on a bad file, key or value (`config_argv_problem` says
    which in one line)."""
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", None, "config file", flag_values=flag_values, lock_config=True, sys_argv=list(argv)
    )
    flag_values(list(argv))
    config = flag_values.config
    if config is not None:
        touch_config(config)
    return config


def apply_config_overrides(config: ml_collections.ConfigDict, argv: Sequence[str]) -> ml_collections.ConfigDict:
    """A locked copy of `config` with each `--config.KEY=VALUE` of `argv` (program name first)
    applied in order, parsed as `main` parses them (a value of the key's type; a key `config` does
    not have is an error). For a config that comes from elsewhere than a `--config=FILE`: the
    recipe's defaults, or a run's config.json. Raises one of `CONFIG_ARGV_ERRORS` on a bad key or
    value (`config_argv_problem(argv, error, base=config)` says which in one line)."""
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_dict("config", copy.deepcopy(config), flag_values=flag_values, sys_argv=list(argv))
    flag_values(list(argv))
    return flag_values.config


def touch_config(config: object) -> None:
    """Raises the OSError that ml_collections keeps back for a config file it could not read
    (its stand-in raises on any attribute access); a loaded config passes."""
    getattr(config, "keys", None)


def _config_file(argv: Sequence[str], name: str) -> str | None:
    """The value of the last `--NAME=FILE` (or `--NAME FILE`) in `argv`."""
    found = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            found = arg.split("=", 1)[1]
        elif arg == f"--{name}" and i + 1 < len(argv):
            found = argv[i + 1]
    return found


def _unknown_key(config: object, key: str) -> str | None:
    """Why the dotted `key` names no field of `config` ('no key `a.b`. Did you mean "c"?'), or None
    when it names one."""
    node, walked = config, []
    for part in key.split("."):
        section = node if isinstance(node, (ml_collections.ConfigDict, Mapping)) else {}
        fields = [str(f) for f in section.keys()]
        if part not in fields:
            close = difflib.get_close_matches(part, fields, n=1)
            hint = f'. Did you mean "{close[0]}"?' if close else ""
            return f"no key `{'.'.join([*walked, part])}`{hint}"
        node = section[part]
        walked.append(part)
    return None


def line_in_file(error: BaseException, path: str) -> int | None:
    """The line of file `path` where `error` was raised from (its innermost frame there), or None
    when its traceback never passed through that file."""
    target, line = os.path.abspath(path), None
    trace = error.__traceback__
    while trace is not None:
        if os.path.abspath(trace.tb_frame.f_code.co_filename) == target:
            line = trace.tb_lineno
        trace = trace.tb_next
    return line


def config_argv_problem(
    argv: Sequence[str], error: BaseException, name: str = "config", base: ml_collections.ConfigDict | None = None
) -> str:
    """One line saying what is wrong with the `--NAME=FILE` / `--NAME.KEY=VALUE` flags of `argv`,
    given the error their parsing raised: the file that is missing or not Python (with the line),
    the key the config does not have (with the nearest one), or the value that does not parse.
    `base`: the config the overrides were applied to when `argv` names no file
    (`apply_config_overrides`)."""
    spec = _config_file(argv, name)
    if base is not None and spec is None and isinstance(error, (KeyError, AttributeError, TypeError, flags.Error)):
        for arg in argv:
            if arg.startswith(f"--{name}."):
                key = arg.split("=", 1)[0].removeprefix(f"--{name}.")
                problem = _unknown_key(base, key)
                if problem is not None:
                    return f"--{name}.{key}: the config has {problem}"
    path = spec.split(":", 1)[0] if spec is not None else None
    if isinstance(error, SyntaxError):
        where = f"{error.filename or path}, line {error.lineno}" if error.lineno else f"{error.filename or path}"
        return f"--{name}={spec}: {where}: {error.msg} (expected a Python file defining get_config())"
    if isinstance(error, OSError) and path is not None:
        if not path:
            return f"--{name}= names no file; expected --{name}=FILE.py"
        if os.path.isdir(path):
            return f"--{name}={spec}: {path} is a directory; expected a Python file defining get_config()"
        if not os.path.exists(path):
            return f"--{name}={spec}: no such file {path}"
        return f"--{name}={spec}: cannot read {path}: {getattr(error, 'strerror', None) or error}"
    if isinstance(error, (KeyError, AttributeError, TypeError)) and spec is not None:
        try:
            config = parse_config_argv(["config", f"--config={spec}"])
        except CONFIG_ARGV_ERRORS:
            config = None
        for arg in argv:
            if arg.startswith(f"--{name}."):
                key = arg.split("=", 1)[0].removeprefix(f"--{name}.")
                problem = _unknown_key(config, key) if config is not None else None
                if problem is not None:
                    return f"--{name}.{key}: the config of {spec} has {problem}"
    line = line_in_file(error, path) if path else None
    if line is not None and not isinstance(error, flags.Error):  # get_config() itself raised
        return f"--{name}={spec}: get_config() of {path} raised {type(error).__name__}: {error} (line {line})"
    text = str(error)
    if CONFIG_CODE_ERROR in text:  # get_config() itself raised; its traceback is in the message
        last = [line for line in text.splitlines() if line.strip()][-1].strip()
        return f"--{name}={spec}: get_config() of {path} raised {last}"
    if isinstance(error, flags.Error):
        return text.removeprefix("flag ")
    return f"--{name}: {str(error).strip() or type(error).__name__}"
