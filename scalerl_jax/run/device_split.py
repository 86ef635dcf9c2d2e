"""`mesh.generator_fraction = 'auto'`: the generator / trainer split picked from measured rates.

Model. A step consumes S samples of P prompt and L completion tokens. With g generator and
t = n - g trainer devices, generating them takes S L / (g r_gen) and training them
S (P + L) / (t r_train), where r_gen is one generator device's completion tokens/s with its decode
slots full (prefill included) and r_train one trainer device's trained (prompt + completion)
tokens/s. PipelineRL overlaps the two, so a step takes the longer; the other side idles for the
difference (generator idle 1 - gen / step, trainer idle 1 - train / step). Every split costs the
same device-hours, so `choose_split` takes the shortest step (the highest throughput); splits
within `tie_tolerance` of it go to the smaller max idle. Only splits the config can run are
candidates (`config.devices.split_candidates`: rows per microbatch over the trainers, mesh
shapes, decode slots over each generator process's devices).

Measurement (`measure_rates`, one process): the run's architecture with random weights (speed
does not depend on the values) on this process's devices: a generation of `sampler.num_slots`
prompts of `data.max_prompt_tokens` tokens with the configured chunk, timed at two lengths (the
difference gives the per-token decode time, the rest the prefill), on one device; and the run's
train step (one microbatch of rows_per_microbatch rows at length P + L, unsorted layout) on a
mesh of every device, timed after its compile. L and P are the budgets (`sampler.max_new_tokens`,
`data.max_prompt_tokens`): completions at the cap. For a cluster of several processes, pick the
split with the simulator instead (`benchmarks/sim_cluster.py --pick_split`) and set the number.

`resolve_generator_fraction` is what `run()` calls first: a config with a number comes back as
is; with 'auto' the split is measured (or, for a resumed workdir, read back from its
`config.json`), logged with its reasoning, and a copy of the config with the number goes on, so
`config.json` records the number.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import logging

from scalerl_jax.config.adapters import optimizer_config_of, train_step_config_of
from scalerl_jax.config.devices import split_candidates
from scalerl_jax.config.errors import ConfigError
from scalerl_jax.config.schema import AUTO_SPLIT


@dataclasses.dataclass(frozen=True)
class Rates:
    """Per-device throughputs and the sample shape they are for (module docstring)."""

    generate_tokens_per_s: float  # completion tokens/s of one generator device, slots full
    train_tokens_per_s: float  # trained (prompt + completion) tokens/s of one trainer device
    prompt_tokens: float  # P per sample
    completion_tokens: float  # L per sample


@dataclasses.dataclass(frozen=True)
class SplitPick:
    """`choose_split`'s answer: the counts, the fraction to set, the reasoning, and per candidate
    (generators, step seconds per sample, generator idle, trainer idle)."""

    num_generators: int
    num_trainers: int
    fraction: float
    reasoning: str
    predicted: tuple[tuple[int, float, float, float], ...]


def predict_split(rates: Rates, num_generators: int, num_trainers: int) -> tuple[float, float, float]:
    """(seconds per sample, generator idle, trainer idle) of a g / t split (module docstring)."""
    generate_s = rates.completion_tokens / (num_generators * rates.generate_tokens_per_s)
    train_s = (rates.prompt_tokens + rates.completion_tokens) / (num_trainers * rates.train_tokens_per_s)
    step_s = max(generate_s, train_s)
    return step_s, 1.0 - generate_s / step_s, 1.0 - train_s / step_s


def choose_split(
    rates: Rates, num_devices: int, generator_counts: Sequence[int], *, tie_tolerance: float = 0.005
) -> SplitPick:
    """The split of `num_devices` among `generator_counts` (candidates) with the shortest predicted
    step; ties within `tie_tolerance` go to the smaller max idle, then to more generators.
    One device: both roles share it (fraction 0.5, nothing to choose)."""
    for name in ("generate_tokens_per_s", "train_tokens_per_s", "completion_tokens"):
        if not getattr(rates, name) > 0:
            raise ValueError(f"choose_split: Rates.{name}={getattr(rates, name)} must be > 0")
    per_device = (
        f"measured per device: generation {rates.generate_tokens_per_s:.4g} completion tokens/s, training "
        f"{rates.train_tokens_per_s:.4g} tokens/s; a sample is {rates.prompt_tokens:g} prompt + "
        f"{rates.completion_tokens:g} completion tokens"
    )
    if num_devices == 1:
        step_s, gen_idle, trn_idle = predict_split(rates, 1, 1)
        return SplitPick(1, 1, 0.5, f"{per_device}; one device: both roles share it", ((1, step_s, 0.0, 0.0),))
    counts = sorted(set(int(g) for g in generator_counts))
    if not counts or not all(1 <= g < num_devices for g in counts):
        raise ValueError(f"choose_split: generator counts {counts} must be non-empty, in [1, {num_devices - 1}]")
    predicted = tuple((g, *predict_split(rates, g, num_devices - g)) for g in counts)
    best = min(step for _, step, _, _ in predicted)
    close = [row for row in predicted if row[1] <= (1 + tie_tolerance) * best]
    g, step_s, gen_idle, trn_idle = min(close, key=lambda row: (max(row[2], row[3]), -row[0]))
    # The continuous balance: g r_gen / L = t r_train / (P + L).
    balance = num_devices / (
        1
        + rates.generate_tokens_per_s
        * (rates.prompt_tokens + rates.completion_tokens)
        / (rates.train_tokens_per_s * rates.completion_tokens)
    )
    lines = [
        per_device,
        f"balanced at {balance:.2f} of {num_devices} devices generating; the splits this config can run:",
        *(
            f"  {gg} generators / {num_devices - gg} trainers: {s * 1e3:.3g} ms per sample, "
            f"generator idle {gi:.0%}, trainer idle {ti:.0%}"
            for gg, s, gi, ti in predicted
        ),
        f"picked {g} / {num_devices - g} (mesh.generator_fraction = {g / num_devices:g}): the shortest step"
        + (f", ties within {tie_tolerance:.1%} to the smaller max idle" if len(close) > 1 else ""),
    ]
    return SplitPick(g, num_devices - g, g / num_devices, "\n".join(lines), predicted)


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_rates(config: ml_collections.ConfigDict, devices: Sequence[Any], *, repeats: int = 2) -> Rates:
    """Times the run's generation (one device) and train step (all `devices`) with random weights
    (module docstring); compiles are excluded, the best of `repeats` timings is kept."""
    import jax
    from flax import nnx

    from scalerl_jax.contracts.batch_layout import ROUTING_KEY, batch_spec, shapes_by_rank
    from scalerl_jax.models import Transformer, make_mesh
    from scalerl_jax.run.programs import model_config_of
    from scalerl_jax.sampler import generate
    from scalerl_jax.train import init_train_state, make_optimizer, make_train_step

    s, b = config.sampler, config.batch
    prompt, budget = config.data.max_prompt_tokens, s.max_new_tokens
    model_config = model_config_of(config)
    rng = np.random.default_rng(config.seed)

    # Generation: all slots filled with prompts of the longest length, at two decode lengths.
    short = min(budget, 2 * s.chunk_steps)
    long = min(budget, 6 * s.chunk_steps)
    prompts = rng.integers(1, model_config.vocab_size, size=(s.num_slots, prompt)).tolist()
    with jax.default_device(devices[0]):
        model = Transformer(model_config, rngs=nnx.Rngs(config.seed))

        def run(tokens: int):
            generate(
                model,
                prompts,
                max_new_tokens=tokens,
                temperature=s.temperature,
                num_slots=s.num_slots,
                chunk_size=s.chunk_steps,
                max_len=prompt + budget,
            )

        run(long)  # compiles
        long_s = _best_time(lambda: run(long), repeats)
        short_s = long_s if long == short else _best_time(lambda: run(short), repeats)
    per_token_s = max((long_s - short_s) / (long - short), 0.0) if long > short else long_s / long
    overhead_s = max(long_s - per_token_s * long, 0.0)  # prefill and host work of one round of slots
    generate_tokens_per_s = s.num_slots * budget / (overhead_s + per_token_s * budget)
    logging.info(
        "device split: generation of %d slots x %d and %d tokens took %.3f s and %.3f s (one device)",
        s.num_slots,
        short,
        long,
        short_s,
        long_s,
    )

    # Training: one microbatch at the full length, on a trainer-shaped mesh of every device.
    devices = list(devices)
    try:
        mesh = make_mesh(config.mesh.trainer_shape, devices=devices)
    except ValueError:
        mesh = make_mesh((1, 1, 1), devices=devices[:1])
    rows = b.prompts_per_step * b.generations_per_prompt // b.microbatches
    rows = -(-rows // mesh.size) * mesh.size
    length = prompt + budget
    graphdef, params = nnx.split(Transformer(model_config, rngs=nnx.Rngs(config.seed)))
    optimizer = make_optimizer(optimizer_config_of(config))
    state, shardings = init_train_state(params, optimizer, mesh=mesh)
    step_config = dataclasses.replace(
        train_step_config_of(config, model_config), num_microbatches=1, sort_by_length=False
    )
    step = make_train_step(graphdef, optimizer, step_config, mesh=mesh, state_shardings=shardings)
    loss_mask = np.zeros((rows, length), np.float32)
    loss_mask[:, prompt:] = 1.0
    batch = {
        "tokens": rng.integers(1, model_config.vocab_size, size=(rows, length)).astype(np.int32),
        "loss_mask": loss_mask,
        "behavior_logp": np.where(loss_mask > 0, -1.0, 0.0).astype(np.float32),
        "rewards": np.where(np.arange(rows) % 2 == 0, 1.0, -1.0).astype(np.float32),
        "group_ids": (np.arange(rows) // 2).astype(np.int32),
        "sample_valid": np.ones((rows,), bool),
    }
    routing = step_config.routing
    if routing:  # a mixture-of-experts policy: nothing recorded, the trainer routes every token
        batch[ROUTING_KEY] = np.full(shapes_by_rank(rows, length, routing)[4], -1, routing.dtype)
    assert set(batch) == set(batch_spec(routing))
    holder = {"state": state}

    def train() -> None:
        holder["state"], metrics = step(holder["state"], batch)
        jax.block_until_ready(metrics)

    train()  # compiles
    train_s = _best_time(train, repeats)
    logging.info(
        "device split: a train step of %d rows x %d tokens took %.3f s on %d device(s)",
        rows,
        length,
        train_s,
        mesh.size,
    )
    return Rates(
        generate_tokens_per_s=generate_tokens_per_s,
        train_tokens_per_s=rows * length / train_s / mesh.size,
        prompt_tokens=float(prompt),
        completion_tokens=float(budget),
    )


def saved_fraction(workdir: str) -> float | None:
    """The numeric `mesh.generator_fraction` in `WORKDIR/config.json` (a run to resume), if any."""
    path = os.path.join(workdir, "config.json")
    try:
        with open(path) as f:
            value = json.load(f)["mesh"]["generator_fraction"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def with_fraction(config: ml_collections.ConfigDict, fraction: float) -> ml_collections.ConfigDict:
    """A copy of `config` with `mesh.generator_fraction` = `fraction`."""
    resolved = copy.deepcopy(config)
    resolved.mesh.generator_fraction = fraction
    return resolved


def resolve_generator_fraction(config: ml_collections.ConfigDict, workdir: str) -> ml_collections.ConfigDict:
    """`config` itself when `mesh.generator_fraction` is a number; for 'auto', a copy with the
    split picked from measured rates (module docstring), logged with its reasoning."""
    if config.mesh.generator_fraction != AUTO_SPLIT:
        return config
    import jax

    saved = saved_fraction(workdir)
    if saved is not None and os.path.isdir(os.path.join(workdir, "checkpoints")):
        logging.info("mesh.generator_fraction='auto': resuming %s, which ran with %g", workdir, saved)
        return with_fraction(config, saved)
    if jax.process_count() > 1:
        raise ConfigError(
            "config key `mesh.generator_fraction` = 'auto' is measured on one process; for a run of "
            f"{jax.process_count()} processes pick the split with the simulator "
            "(benchmarks/sim_cluster.py --pick_split, with the per-token costs of the sampler and "
            "train-step benchmarks) and set the number"
        )
    devices = jax.devices()
    candidates = split_candidates(config, len(devices))
    start = time.perf_counter()
    rates = measure_rates(config, devices)
    pick = choose_split(rates, len(devices), candidates)
    for line in pick.reasoning.splitlines():
        logging.info("mesh.generator_fraction='auto': %s", line)
    logging.info(
        "mesh.generator_fraction='auto' -> %g (%d generator / %d trainer devices; measured in %.1f s)",
        pick.fraction,
        pick.num_generators,
        pick.num_trainers,
        time.perf_counter() - start,
    )
    return with_fraction(config, pick.fraction)
