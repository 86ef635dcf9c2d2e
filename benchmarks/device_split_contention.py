"""Do the generator and the trainer of a CPU run compete for the same cores? (device_split.py)

On CPU, `--xla_force_host_platform_device_count=2` makes two devices over the same host cores, so
the tiny run's one generator device and one trainer device are not independent: while the
generator decodes, the trainer's step runs on what cores are left, and while the generator is
blocked (lag bound), the trainer has them all. This times, with the tiny recipe's architecture
(random weights) and the `run.device_split` measurement's shapes:
  the train step on device 1, alone and while device 0 generates without pause;
  a generation on device 0, alone and while device 1 trains without pause.
Ratios > 1 mean the two sides share compute: a generator's idle time is then not idle hardware.

  XLA_FLAGS=--xla_force_host_platform_device_count=2 .venv/bin/python benchmarks/device_split_contention.py
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from scalerl_jax.config import recipes  # noqa: E402
from scalerl_jax.config.adapters import optimizer_config_of, train_step_config_of
from scalerl_jax.models import Transformer, make_mesh  # noqa: E402
from scalerl_jax.run.programs import model_config_of  # noqa: E402
from scalerl_jax.sampler import generate  # noqa: E402
from scalerl_jax.train import init_train_state, make_optimizer, make_train_step  # noqa: E402


def main() -> None:
    config = recipes.tiny()
    s, b = config.sampler, config.batch
    prompt, budget = config.data.max_prompt_tokens, s.max_new_tokens
    model_config = model_config_of(config)
    rng = np.random.default_rng(0)
    generator_device, trainer_device = jax.devices()[:2]

    prompts = rng.integers(1, model_config.vocab_size, size=(s.num_slots, prompt)).tolist()
    with jax.default_device(generator_device):
        gen_model = Transformer(model_config, rngs=nnx.Rngs(0))

    def generation() -> None:
        with jax.default_device(generator_device):
            generate(
                gen_model,
                prompts,
                max_new_tokens=budget,
                temperature=s.temperature,
                num_slots=s.num_slots,
                chunk_size=s.chunk_steps,
                max_len=prompt + budget,
            )

    mesh = make_mesh((1, 1, 1), devices=[trainer_device])
    rows, length = b.prompts_per_step * b.generations_per_prompt, prompt + budget
    graphdef, params = nnx.split(Transformer(model_config, rngs=nnx.Rngs(0)))
    optimizer = make_optimizer(optimizer_config_of(config))
    state, shardings = init_train_state(params, optimizer, mesh=mesh)
    step_config = dataclasses.replace(train_step_config_of(config, model_config), sort_by_length=False)
    step = make_train_step(graphdef, optimizer, step_config, mesh=mesh, state_shardings=shardings)
    mask = np.zeros((rows, length), np.float32)
    mask[:, prompt:] = 1.0
    batch = {
        "tokens": rng.integers(1, model_config.vocab_size, size=(rows, length)).astype(np.int32),
        "loss_mask": mask,
        "behavior_logp": -mask,
        "rewards": np.where(np.arange(rows) % 2 == 0, 1.0, -1.0).astype(np.float32),
        "group_ids": (np.arange(rows) // 2).astype(np.int32),
        "sample_valid": np.ones((rows,), bool),
    }
    holder = {"state": state}

    def train() -> None:
        holder["state"], metrics = step(holder["state"], batch)
        jax.block_until_ready(metrics)

    def timed(fn, repeats: int = 3) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    def beside(background, fn) -> float:
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                background()

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        time.sleep(0.5)
        try:
            return timed(fn)
        finally:
            stop.set()
            thread.join()

    generation()  # compiles
    train()
    print(f"{os.cpu_count()} host cores; train step {rows} x {length}, generation {s.num_slots} slots x {budget}")
    train_alone = timed(train)
    train_busy = beside(generation, train)
    gen_alone = timed(generation)
    gen_busy = beside(train, generation)
    print(
        f"train step: alone {train_alone:.3f} s, beside generation {train_busy:.3f} s ({train_busy / train_alone:.2f}x)"
    )
    print(f"generation: alone {gen_alone:.3f} s, beside training {gen_busy:.3f} s ({gen_busy / gen_alone:.2f}x)")


if __name__ == "__main__":
    main()
