"""One run of a study: a base config with one leave-one-out change, as `python -m scalerl_jax.cli.study`
runs it: `--config=configs/study.py:configs/tiny.py,dapo` (BASE,VARIANT; VARIANT 'baseline' is the
base unchanged, else a name of config.recipes.LEAVE_ONE_OUT; BASE may be 'file.py:arg').
"""

from scalerl_jax.config.variants import study_config


def get_config(arg: str):
    return study_config(arg)
