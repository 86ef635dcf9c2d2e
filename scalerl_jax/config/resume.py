"""A workdir holding checkpoints is resumed only with the config it was started with, except for
the keys the schema marks resumable (`schema.RESUMABLE`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections

from scalerl_jax.config import schema
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.schema import flat_keys, get_key


def config_json(config: ml_collections.ConfigDict) -> dict:
    """The config as written to `WORKDIR/config.json` (tuples become lists)."""
    return json.loads(json.dumps(config.to_dict(), sort_keys=True, default=str))


def flat_config(config: Any) -> dict[str, Any]:
    """`{dotted_key: value}` of a config or its JSON form (the fingerprint stored in checkpoints)."""
    as_json = config_json(config) if isinstance(config, ml_collections.ConfigDict) else config
    return {key: get_key(as_json, key) for key in flat_keys(as_json)}


def changed_keys(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Keys (other than `schema.RESUMABLE`) whose flat values differ, as '`key` (old -> new)'."""
    keys = sorted(k for k in set(saved) | set(new) if saved.get(k) != new.get(k) and k not in schema.RESUMABLE)
    return [f"`{k}` ({saved.get(k)!r} -> {new.get(k)!r})" for k in keys]


def check_resume(
    config: ml_collections.ConfigDict, workdir: str, saved_fingerprint: dict[str, Any] | None = None
) -> None:
    """A workdir holding checkpoints is resumed only with the config it was started with.

    Compares with `WORKDIR/config.json`, or, when that file is missing or malformed, with
    `saved_fingerprint` (the flat config stored in the newest checkpoint). Raises ConfigError
    naming the keys that differ (other than `schema.RESUMABLE`).
    """
    saved_path = os.path.join(workdir, "config.json")
    checkpoints = os.path.join(workdir, "checkpoints")
    if not (os.path.isdir(checkpoints) and os.listdir(checkpoints)):
        return
    saved, source = None, saved_path
    if os.path.isfile(saved_path):
        try:
            with open(saved_path) as f:
                saved = flat_config(json.load(f))
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            if saved_fingerprint is None:
                raise ConfigError(
                    f"{saved_path} is malformed ({e}) and no checkpoint carries the "
                    "run's config: cannot check that this config matches the run"
                ) from e
    if saved is None:
        if saved_fingerprint is None:
            raise ConfigError(
                f"workdir {workdir!r} holds checkpoints but neither {saved_path} nor a "
                "checkpoint records the run's config: refusing to resume blind"
            )
        saved, source = saved_fingerprint, "the config stored in its newest checkpoint"
    changed = changed_keys(saved, flat_config(config))
    if changed:
        raise ConfigError(
            f"workdir {workdir!r} holds checkpoints of a run with a different config ({source}); "
            f"changed keys: {', '.join(changed[:8])}{' ...' if len(changed) > 8 else ''}. Use a new "
            f"--workdir, or the config of that run (only {', '.join(schema.RESUMABLE)} may change on resume)"
        )
