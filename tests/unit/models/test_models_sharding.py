"""Sharding on 8 fake CPU devices (tests/conftest.py sets XLA_FLAGS before jax is imported).

Forward logits and gradients on meshes (8,1,1), (1,4,2), (2,2,2) equal the single-device result;
parameter shardings equal a table of expected PartitionSpecs written out by hand below.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scalerl_jax.models import (
    get_preset,
    init_kv_cache,
    init_transformer,
    logical_to_spec,
    make_mesh,
    param_shardings,
    sequence_logprobs,
    split_devices,
    use_mesh_rules,
)
from scalerl_jax.models.sharding import constrain
from scalerl_jax.models.transformer import DecoderLayer

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in tests/conftest.py)")

# DEFAULT_RULES by hand for the stacked tiny-llama: embed -> fsdp, heads/kv_heads/mlp/vocab -> tensor,
# layers/head_dim/norm -> replicated.
EXPECTED_SPECS = {
    "embed_tokens": ("tensor", "fsdp"),
    "layers.attn.q_proj": (None, "fsdp", "tensor", None),
    "layers.attn.k_proj": (None, "fsdp", "tensor", None),
    "layers.attn.v_proj": (None, "fsdp", "tensor", None),
    "layers.attn.o_proj": (None, "tensor", None, "fsdp"),
    "layers.mlp.gate_proj": (None, "fsdp", "tensor"),
    "layers.mlp.up_proj": (None, "fsdp", "tensor"),
    "layers.mlp.down_proj": (None, "tensor", "fsdp"),
    "layers.attn_norm.scale": (None, None),
    "layers.mlp_norm.scale": (None, None),
    "final_norm.scale": (None,),
    "lm_head": ("fsdp", "tensor"),
}


def _flat(tree):
    """{'a.b': leaf value} for an NNX state (variables unwrapped)."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        out[".".join(str(getattr(p, "key", p)) for p in path if not isinstance(p, jax.tree_util.GetAttrKey))] = leaf
    return out


def _padded(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


@pytest.fixture(scope="module")
def reference():
    config = get_preset("tiny-llama")
    model = init_transformer(config, seed=0)
    graphdef, params = nnx.split(model)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (8, 16)))
    weights = jnp.asarray(np.random.RandomState(1).randn(8, 16), jnp.float32)

    def objective(p, t):
        """(sum of weighted log-probs, logits): one compiled program gives logits and gradients."""
        model = nnx.merge(graphdef, p)
        return jnp.sum(weights * sequence_logprobs(model, t, chunk_size=8)), model(t)

    grads, logits = jax.jit(jax.grad(objective, has_aux=True))(params, tokens)
    return graphdef, params, tokens, objective, logits, grads


@pytest.mark.parametrize("mesh_shape", [pytest.param((8, 1, 1), marks=pytest.mark.slow), (1, 4, 2), (2, 2, 2)])
def test_sharded_forward_and_grads_equal_single_device(reference, mesh_shape):
    graphdef, params, tokens, objective, ref_logits, ref_grads = reference
    mesh = make_mesh(mesh_shape)
    shardings = param_shardings(params, mesh)
    sharded_params = jax.device_put(params, shardings)
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    sharded_tokens = jax.device_put(tokens, batch_sharding)
    with use_mesh_rules(mesh):
        grads, logits = jax.jit(
            jax.grad(objective, has_aux=True), in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None)
        )(sharded_params, sharded_tokens)
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    assert logits.sharding.shard_shape(logits.shape)[0] == 8 // batch_shards  # activations batch-sharded
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-6)
    ref_flat, got_flat = _flat(ref_grads), _flat(grads)
    for name, ref in ref_flat.items():
        scale = float(np.abs(np.asarray(ref)).max())
        np.testing.assert_allclose(
            np.asarray(got_flat[name]), np.asarray(ref), rtol=1e-5, atol=1e-5 * scale, err_msg=name
        )
    for tree in (sharded_params, grads):
        for name, leaf in _flat(tree).items():
            assert _padded(leaf.sharding.spec, leaf.ndim) == EXPECTED_SPECS[name], name
    assert set(_flat(sharded_params)) == set(EXPECTED_SPECS)


@pytest.mark.slow
def test_init_transformer_directly_on_mesh():
    mesh = make_mesh((1, 4, 2))
    model = init_transformer(get_preset("tiny-llama"), seed=0, mesh=mesh)
    assert isinstance(model.layers, DecoderLayer)  # scan_layers: one stacked layer
    gate = model.layers.mlp.gate_proj[...]
    assert {s.data.shape for s in gate.addressable_shards} == {(2, 16, 64)}  # [L, 64/4, 128/2]


def test_kv_cache_created_on_its_sharding():
    mesh = make_mesh((1, 4, 2))
    cache = init_kv_cache(get_preset("tiny-llama"), batch=4, max_len=8, mesh=mesh)
    # layers, batch (data*fsdp = 4), length, kv_heads (tensor = 2), head_dim
    sharding = cache["k"].sharding
    assert isinstance(sharding, jax.sharding.NamedSharding)
    assert _padded(sharding.spec, 5) == (None, ("data", "fsdp"), None, "tensor", None)
    assert {s.data.shape for s in cache["v"].addressable_shards} == {(2, 1, 8, 1, 16)}


def test_logical_to_spec_rules():
    rules = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("heads", "tensor"))
    # 'fsdp' is taken by batch, so embed is replicated; unknown names replicate.
    assert logical_to_spec(("batch", "embed", "heads", "other"), rules) == P(("data", "fsdp"), None, "tensor", None)
    mesh = make_mesh((1, 4, 2))
    with pytest.raises(ValueError, match=r"attn\.k: dimension 1 \('heads', size 3\) is not divisible"):
        logical_to_spec(("embed", "heads"), rules, mesh=mesh, shape=(8, 3), name="attn.k")
    assert logical_to_spec(("heads",), rules, mesh={"tensor": 2}) == P("tensor")


def test_constrain_is_a_noop_without_mesh():
    x = jnp.ones((4, 3, 2))
    assert constrain(x, ("batch", "length", None)) is x


def test_make_mesh_and_split_devices():
    devices = jax.devices()
    mesh = make_mesh((2, -1, 2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    with pytest.raises(ValueError, match="needs 6 devices, got 8"):
        make_mesh((3, 2, 1))
    with pytest.raises(ValueError, match="at most one entry may be -1"):
        make_mesh((-1, -1, 1))
    gen, train = split_devices(devices, 0.25)
    assert len(gen) == 2 and len(train) == 6 and not set(gen) & set(train)
    assert split_devices(devices, 0.01) == (devices[-1:], devices[:-1])  # each side keeps one device; generators last
    assert split_devices(devices[:1], 0.5) == (devices[:1], devices[:1])  # single device: shared
    with pytest.raises(ValueError, match="generator_fraction=1.0"):
        split_devices(devices, 1.0)
    sub_mesh = make_mesh((1, -1, 1), devices=train)
    assert sub_mesh.devices.size == 6
