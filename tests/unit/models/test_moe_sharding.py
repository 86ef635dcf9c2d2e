"""Expert parallelism on 8 fake CPU devices (tests/conftest.py): a Qwen3-MoE policy's experts are
split whole over the fsdp mesh axis (2 or 4 experts' shares per device) and computed by the
shard_map dispatch (`moe.experts_dispatched`), and the sharded forward and gradient equal the
single-device ones in float32, for both ways of computing the experts; the layout the dispatch
reads off the mesh and rules, by hand; the 'no expert' index the dispatch gives other devices'
pairs, against a numpy loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scalerl_jax.models import get_preset, init_transformer, make_mesh, param_shardings, use_mesh_rules
from scalerl_jax.models.logprobs import next_token_logprobs
from scalerl_jax.models.moe import experts_dense, experts_ragged
from scalerl_jax.models.sharding import ExpertParallel, expert_parallel

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS in tests/conftest.py)")


def _objective(graphdef, weights, mask):
    """(sum of weighted log-probs + the load-balancing loss, logits) of params and tokens."""

    def objective(params, tokens):
        model = nnx.merge(graphdef, params)
        hidden, routing = model.hidden_with_routing(tokens, mask)
        logp, _ = next_token_logprobs(model.head, hidden, tokens, temperature=1.0, chunk_size=8, with_entropy=False)
        aux = jnp.sum(routing.expert_prob * routing.expert_tokens) / jnp.sum(routing.tokens) ** 2
        return jnp.sum(weights * logp) + aux, model.head(hidden)

    return objective


# Llama 4's layer kinds at tiny size: a shared expert beside sigmoid top-1 routing, layers 0 and 2
# chunked RoPE, 1 and 3 NoPE (scanned as 2 stacks of 2).
TINY_LLAMA4_MOE = dict(
    family="llama4",
    num_layers=4,
    routing="sigmoid_topk",
    norm_topk_prob=False,
    num_experts_per_tok=1,
    shared_expert_intermediate_size=32,
    qk_norm=False,
    qk_l2_norm=True,
    nope_layers=(1, 3),
    chunked_attention_layers=(0, 2),
    attention_chunk_size=8,
    attn_temperature_tuning=True,
    attn_floor_scale=4.0,
)


@pytest.mark.parametrize("moe_impl", ["dense", "ragged"])
@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (1, 4, 2)], ids=["experts_over_2", "experts_over_4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "llama4"])
def test_expert_parallel_forward_and_grads_equal_single_device(moe_impl, mesh_shape, family):
    fields = TINY_LLAMA4_MOE if family == "llama4" else {}
    config = get_preset("tiny-qwen3-moe", scan_layers=True, moe_impl=moe_impl, **fields)
    graphdef, params = nnx.split(init_transformer(config, seed=0))
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, config.vocab_size, (8, 16)))
    objective = _objective(graphdef, jnp.asarray(rng.randn(8, 16), jnp.float32), jnp.ones((8, 16)))
    ref_grads, ref_logits = jax.jit(jax.grad(objective, has_aux=True))(params, tokens)

    mesh = make_mesh(mesh_shape)
    shardings = param_shardings(params, mesh)
    stacked = shardings["layers"][0] if family == "llama4" else shardings["layers"]  # period 2: stacks 0 and 1
    expert_spec = stacked["moe"]["gate_proj"].get_value().spec
    assert tuple(expert_spec) == (None, "fsdp", None, "tensor")  # [layers, expert, embed, mlp]
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    with use_mesh_rules(mesh):
        grads, logits = jax.jit(
            jax.grad(objective, has_aux=True), in_shardings=(shardings, batch), out_shardings=(shardings, None)
        )(jax.device_put(params, shardings), jax.device_put(tokens, batch))
    with use_mesh_rules(mesh):
        assert "shard_map" in str(jax.make_jaxpr(objective)(params, tokens))  # the dispatch, not XLA's partitioner
    experts_per_device = config.num_experts // mesh.shape["fsdp"]
    gate = (grads["layers"][0] if family == "llama4" else grads["layers"])["moe"]["gate_proj"].get_value()
    assert gate.sharding.shard_shape(gate.shape)[1] == experts_per_device
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)
    for (path, ref), got in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        scale = float(np.abs(np.asarray(ref)).max())
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * scale, err_msg=str(path))


def test_expert_parallel_layout_by_hand():
    """Tokens over data x fsdp, experts over fsdp, width over tensor (the default rules); no layout
    without a mesh, with experts over one device, or when the tokens or experts do not divide."""
    mesh = make_mesh((2, 2, 2))
    with use_mesh_rules(mesh):
        assert expert_parallel(16, 8) == ExpertParallel(mesh, ("data", "fsdp"), "fsdp", "tensor")
        assert expert_parallel(6, 8) is None  # 6 tokens over 4 shards
        assert expert_parallel(16, 3) is None  # 3 experts over 2
    with use_mesh_rules(make_mesh((2, 1, 4))):
        assert expert_parallel(16, 8) is None  # fsdp of 1: every device holds every expert
    assert expert_parallel(16, 8) is None  # no mesh


@pytest.mark.parametrize("compute", [experts_dense, experts_ragged])
@pytest.mark.parametrize("scale_input", [False, True])
def test_pairs_naming_no_expert_add_nothing(compute, scale_input):
    """Expert index E (one past the last) marks a pair another device computes: the result is the
    numpy sum over the other pairs alone."""
    rng = np.random.default_rng(1)
    n, d, e, f, k = 10, 6, 4, 5, 2
    x = rng.normal(size=(n, d)).astype(np.float32)
    gate, up, down = (rng.normal(size=s).astype(np.float32) for s in ((e, d, f), (e, d, f), (e, f, d)))
    weights = rng.uniform(0.1, 1.0, size=(n, k)).astype(np.float32)
    experts = np.stack([rng.choice(e, size=k, replace=False) for _ in range(n)]).astype(np.int32)
    experts[rng.uniform(size=(n, k)) < 0.4] = e
    want = np.zeros((n, d))
    for t in range(n):
        for w, j in zip(weights[t], experts[t]):
            if j < e:
                inp = w * x[t] if scale_input else x[t]
                g, u = inp @ gate[j], inp @ up[j]
                y = (g / (1 + np.exp(-g)) * u) @ down[j]
                want[t] += y if scale_input else w * y
    got = compute(*(jnp.asarray(a) for a in (x, weights, experts, gate, up, down)), scale_input=scale_input)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("max_gathered", [32, 8])
def test_the_dispatch_in_blocks_equals_one_device(max_gathered):
    """32 tokens over fsdp 4 (8 a device), 8 experts over the same 4 devices, width over tensor 2:
    gathering all 32 at once, or in 4 blocks of 8 (max_gathered 8: 2 tokens a device per block,
    under jax.checkpoint), gives the single-device output and gradients."""
    from scalerl_jax.models.moe import experts_dispatched

    rng = np.random.default_rng(2)
    n, d, e, f, k = 32, 8, 8, 6, 2
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(n, k)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(e, size=k, replace=False) for _ in range(n)]), jnp.int32)
    gate, up, down = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((e, d, f), (e, d, f), (e, f, d)))
    cotangent = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)

    def loss(compute):
        return lambda x, gate, up, down: jnp.sum(compute(x, weights, experts, gate, up, down) * cotangent)

    want_loss, want_grads = jax.value_and_grad(loss(experts_dense), argnums=(0, 1, 2, 3))(x, gate, up, down)
    mesh = make_mesh((1, 4, 2))
    with use_mesh_rules(mesh):
        layout = expert_parallel(n, e)
        assert layout is not None and layout.expert_axis == "fsdp"
        dispatched = functools.partial(
            experts_dispatched, layout=layout, compute=experts_dense, max_gathered_tokens=max_gathered
        )
        got_loss, got_grads = jax.jit(jax.value_and_grad(loss(dispatched), argnums=(0, 1, 2, 3)))(x, gate, up, down)
        jaxpr = str(jax.make_jaxpr(loss(dispatched))(x, gate, up, down))
    assert ("scan" in jaxpr) == (max_gathered < 32)  # blocks run one after another only when asked
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
