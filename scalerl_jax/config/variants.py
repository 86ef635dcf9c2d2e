"""Which configs a study runs: a base config file with one leave-one-out change per variant.

A study variant is `'baseline'` (the base config as it is) or a name of `recipes.LEAVE_ONE_OUT`
applied on top of the base (`'dapo'`: the base with CISPO reverted to DAPO). `'loo'` in a
variant list stands for the baseline and every leave-one-out variant. The run's config file is
`configs/study.py:BASE,VARIANT`, where BASE is a config file as `--config` takes it (`file.py`
or `file.py:arg`), so that each run of a study is an ordinary `main` run with its own config.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys

import ml_collections

from scalerl_jax.config import recipes

BASELINE = "baseline"
ALL_LEAVE_ONE_OUT = "loo"


def expand_variants(names: str) -> list[str]:
    """'baseline,dapo' -> ['baseline', 'dapo']; 'loo' -> baseline then every leave-one-out
    variant. Duplicates are dropped (first kept); an unknown name is a ValueError naming it."""
    known = [BASELINE, *recipes.LEAVE_ONE_OUT]
    expanded: list[str] = []
    for name in (n.strip() for n in names.split(",")):
        for variant in known if name == ALL_LEAVE_ONE_OUT else [name]:
            if variant not in known:
                raise ValueError(f"unknown study variant {variant!r}; choose from {known} or {ALL_LEAVE_ONE_OUT!r}")
            if variant not in expanded:
                expanded.append(variant)
    return expanded


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """`get_config()` of a config file, or `get_config(arg)` for 'file.py:arg' (as `--config` reads it)."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise ValueError(f"study base config {path!r} is not a file")
    module_spec = importlib.util.spec_from_file_location(f"_study_base_{abs(hash(path))}", path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"study base config {path!r} cannot be imported as a python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def split_study_arg(arg: str) -> tuple[str, str]:
    """'BASE,VARIANT' -> (BASE, VARIANT); BASE may hold its own ':arg' (the last comma splits)."""
    base, sep, variant = arg.rpartition(",")
    if not sep or not base or not variant:
        raise ValueError(f"configs/study.py takes 'BASE_CONFIG,VARIANT' (e.g. 'configs/tiny.py,dapo'), got {arg!r}")
    return base, variant


def variant_config(base: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
    """A copy of `base` with `variant`'s leave-one-out change (`'baseline'`: unchanged)."""
    config = copy.deepcopy(base)
    if variant == BASELINE:
        return config
    if variant not in recipes.LEAVE_ONE_OUT:
        raise ValueError(
            f"unknown study variant {variant!r}; choose {BASELINE!r} or one of {sorted(recipes.LEAVE_ONE_OUT)}"
        )
    recipes.LEAVE_ONE_OUT[variant](config)
    return config


def study_config(arg: str) -> ml_collections.ConfigDict:
    """The config of one study run from 'BASE,VARIANT' (module docstring)."""
    base, variant = split_study_arg(arg)
    return variant_config(load_config_file(base), variant)
