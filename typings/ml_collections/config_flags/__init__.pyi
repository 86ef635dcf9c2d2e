from typing import Any

from absl import flags
from ml_collections import ConfigDict

def DEFINE_config_file(
    name: str,
    default: str | None = None,
    help_string: str = "path to config file.",
    flag_values: flags.FlagValues = ...,
    lock_config: bool = True,
    accept_new_attributes: bool = False,
    sys_argv: list[str] | None = None,
    **kwargs: Any,
) -> flags.FlagHolder[ConfigDict]: ...
def DEFINE_config_dict(
    name: str,
    config: ConfigDict,
    help_string: str = "ConfigDict instance.",
    flag_values: flags.FlagValues = ...,
    lock_config: bool = True,
    accept_new_attributes: bool = False,
    sys_argv: list[str] | None = None,
    **kwargs: Any,
) -> flags.FlagHolder[ConfigDict]: ...
