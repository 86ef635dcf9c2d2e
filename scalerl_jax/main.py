"""The RL job: `python -m scalerl_jax.main --config=configs/scalerl_8b.py --workdir=DIR`.

Builds everything from one ml_collections config (validated first), then runs the PipelineRL-k
or PPO-off-policy-k loop: data -> sampler -> pipeline queue -> train step -> new params ->
sampler. Writes `DIR/config.json`, `DIR/metrics.jsonl`, TensorBoard events in `DIR/tb`, orbax
checkpoints in `DIR/checkpoints` (resumed from automatically), and at the end a sigmoid fit of
the run's own pass-rate curve (`DIR/scaling.png`).
"""
from __future__ import annotations

import json
import os
import time

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from scalerl_jax.config_validation import check_resume, config_json, validate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to an ml_collections config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for metrics, checkpoints and artifacts.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if os.environ.get("SCALERL_DISTRIBUTED") == "1":
        jax.distributed.initialize()
    config, workdir = _CONFIG.value, _WORKDIR.value
    validate(config, num_devices=len(jax.devices()))
    check_resume(config, workdir)
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(config_json(config), f, indent=2, sort_keys=True)
    from scalerl_jax.runner import run  # heavy imports after the config is known to be good

    start = time.time()
    summary = run(config, workdir)
    logging.info("run finished in %.1f min: %s", (time.time() - start) / 60, summary)


if __name__ == "__main__":
    app.run(main)
