"""The engine on a generator mesh of 4 of the 8 fake CPU devices == the single-device engine (slow: ~30 s of compiles)."""

import jax
import numpy as np
import pytest
from flax import nnx

from scalerl_jax.models import Transformer, get_preset, make_mesh, param_shardings, split_devices
from scalerl_jax.sampler import ContinuousBatcher, Engine, EngineConfig, Request
from scalerl_jax.telemetry.compile_events import compile_log

CONFIG = get_preset("tiny-llama", initializer_range=0.15)


def run(engine, params, prompts):
    batcher = ContinuousBatcher(engine, params, seed=1)
    for i, prompt in enumerate(prompts):
        batcher.add_request(Request(i, prompt, 6, seed=i, temperature=0.0 if i % 2 else 1.0))
    return {c.request_id: c for c in batcher.drain()}


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_sharded_generator_mesh_matches_single_device():
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    engine_config = EngineConfig(num_slots=4, max_len=32, chunk_size=4, prefill_chunk=8, max_prefill_rows=4)
    prompts = [np.random.default_rng(i).integers(0, CONFIG.vocab_size, 3 + i).tolist() for i in range(6)]
    single = run(Engine(graphdef, CONFIG, engine_config), params, prompts)

    generator_devices, _ = split_devices(jax.devices(), 0.5)
    mesh = make_mesh((2, 1, 2), devices=generator_devices)  # slots over data, heads over tensor
    sharded_params = jax.device_put(params, param_shardings(params, mesh))
    engine = Engine(graphdef, CONFIG, engine_config, mesh=mesh)
    batcher_out = run(engine, sharded_params, prompts)
    state = engine.init_decode_state()
    assert set(state.cache["k"].sharding.device_set) == set(generator_devices)
    assert state.cache["k"].sharding.spec[1] is not None  # slots are sharded
    for i in range(len(prompts)):
        assert batcher_out[i].tokens == single[i].tokens, i
        np.testing.assert_allclose(batcher_out[i].logprobs, single[i].logprobs, atol=1e-5)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_params_push_to_the_generator_never_touches_the_host():
    """The pipeline's push (`update_params`): trainer params sharded over 4 devices (fsdp-like,
    rows) -> the generator's tensor-parallel layout on the other 4, with explicit host transfers
    disallowed both ways (on CPU the device-to-host guard alone never trips; the host-to-device
    one catches a round trip through numpy, which `jax.device_put` takes for this reshard)."""
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    generator_devices, trainer_devices = split_devices(jax.devices(), 0.5)
    trainer_params = jax.device_put(params, param_shardings(params, make_mesh((1, 4, 1), devices=trainer_devices)))
    generator_mesh = make_mesh((2, 1, 2), devices=generator_devices)  # slots over data, heads over tensor
    engine = Engine(graphdef, CONFIG, EngineConfig(num_slots=4, max_len=16, chunk_size=2), mesh=generator_mesh)
    batcher = ContinuousBatcher(engine, jax.device_put(params, param_shardings(params, generator_mesh)))
    expected = jax.tree.map(np.asarray, trainer_params)
    with jax.transfer_guard_host_to_device("disallow_explicit"), jax.transfer_guard_device_to_host("disallow_explicit"):
        batcher.update_params(trainer_params, 1)
        batcher.run_chunk()  # adopts version 1
    for leaf in jax.tree.leaves(trainer_params):
        leaf.delete()  # the next train step donates them: the generator must hold its own copy
    adopted = batcher.params
    assert batcher.version == 1
    for got, want, target in zip(
        jax.tree.leaves(adopted), jax.tree.leaves(expected), jax.tree.leaves(param_shardings(params, generator_mesh))
    ):
        assert got.sharding == target
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_decoding_after_warm_up_compiles_nothing_on_a_generator_mesh():
    """`warm_up` compiles each decode-path program once, for the decode state it has at that
    point; on a mesh of several devices every later call must see the state on the same
    shardings, else the prefill of a bucket and the decode chunk compile again while decoding
    (seen in a run's evaluations after step 0). Prompts of 2 .. 12 tokens: both prefill buckets
    (8, 16) and the decode window (32)."""
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    generator_devices, _ = split_devices(jax.devices(), 0.5)
    mesh = make_mesh((4, 1, 1), devices=generator_devices)  # slots over data
    engine_config = EngineConfig(num_slots=4, max_len=32, chunk_size=4, prefill_chunk=8, max_prefill_rows=1)
    engine = Engine(graphdef, CONFIG, engine_config, mesh=mesh)
    batcher = ContinuousBatcher(engine, jax.device_put(params, param_shardings(params, mesh)), seed=1)
    batcher.warm_up(16)
    log = compile_log()
    before = log.count()
    for i in range(4):
        batcher.add_request(Request(i, list(range(1, 3 + 3 * i)), 6, seed=i, temperature=1.0))
    assert len(batcher.drain()) == 4
    assert log.events(before) == []
