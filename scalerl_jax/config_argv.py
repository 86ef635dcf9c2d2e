"""`--config=FILE [--config.KEY=VALUE ...]` parsed outside `main`, the way `main` parses it."""

from __future__ import annotations

from collections.abc import Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

# What the parser raises on bad input: absl's flag errors (a value of the wrong type among them),
# and KeyError or AttributeError for a key the config does not have.
CONFIG_ARGV_ERRORS = (flags.Error, ValueError, TypeError, KeyError, AttributeError)


def parse_config_argv(argv: Sequence[str]) -> ml_collections.ConfigDict | None:
    """The config that `argv` (program name first) names: the file of `--config=FILE`, then each
    `--config.KEY=VALUE` applied in order, and the result locked (no new keys), as `main`'s
    `config_flags.DEFINE_config_file(..., lock_config=True)` does; None without `--config=FILE`.
    Raises one of `CONFIG_ARGV_ERRORS` on a bad file, key or value."""
    flag_values = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", None, "config file", flag_values=flag_values, lock_config=True, sys_argv=list(argv)
    )
    flag_values(list(argv))
    return flag_values.config
