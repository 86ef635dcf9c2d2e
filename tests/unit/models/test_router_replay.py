"""Router replay: the sampler records the experts each MoE layer routed every fed token to, and the
trainer's forward can compute those tokens with the recorded experts (weighted by its own gates).

- the replayed block against a numpy loop with the given experts, and the mismatch counts by hand;
- the experts the engine records while decoding against transformers' own router top-k over the
  finished sequence (Qwen3-MoE and Llama 4 built by transformers, no download);
- a near tie: two experts whose router columns differ by a hair, so that the sampler's decode
  program and the trainer's full forward pick different experts for some tokens at the same
  weights; the trainer's log-probs then differ from the sampler's, and with the recorded experts
  replayed they equal them: in the model's forward, and through the train batch and train step
  (`rl.router_replay`), where the mismatch share is logged either way.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import moe_checkpoints  # noqa: E402  (tests/support)
from flax import nnx  # noqa: E402

from scalerl_jax.contracts.batch_layout import Routing  # noqa: E402
from scalerl_jax.models import get_preset, hf  # noqa: E402
from scalerl_jax.models.logprobs import next_token_logprobs  # noqa: E402
from scalerl_jax.models.moe import experts_dense, gate_weights, router_stats  # noqa: E402
from scalerl_jax.models.transformer import DecoderLayer, init_transformer  # noqa: E402
from scalerl_jax.pipeline.batching import build_train_batch  # noqa: E402
from scalerl_jax.pipeline.group import Group, Prompt  # noqa: E402
from scalerl_jax.sampler import generate  # noqa: E402
from scalerl_jax.train import TrainStepConfig  # noqa: E402
from scalerl_jax.train.step import accumulate_gradients  # noqa: E402


def _numpy_replayed(x, router, gate, up, down, experts, routing, normalize):
    """y[n] = sum over the given experts e of token n of its SwiGLU output weighted by this router's
    gate for e (softmax_topk: p_e, renormalized; sigmoid_topk: sigmoid(logit_e) scaling the input)."""
    out = np.zeros_like(x)
    for n, token in enumerate(x):
        logits = token @ router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        if routing == "sigmoid_topk":
            weights = 1.0 / (1.0 + np.exp(-logits[experts[n]]))
        else:
            weights = probs[experts[n]] / (probs[experts[n]].sum() if normalize else 1.0)
        for w, e in zip(weights, experts[n]):
            inp = w * token if routing == "sigmoid_topk" else token
            g, u = inp @ gate[e], inp @ up[e]
            y = (g / (1 + np.exp(-g)) * u) @ down[e]
            out[n] += y if routing == "sigmoid_topk" else w * y
    return out


@pytest.mark.parametrize(
    "routing, normalize", [("softmax_topk", True), ("softmax_topk", False), ("sigmoid_topk", False)]
)
def test_replayed_experts_equal_a_numpy_loop(routing, normalize):
    rng = np.random.default_rng(0)
    n, d, e, f, k = 12, 8, 5, 6, 2
    x = rng.normal(size=(n, d))
    router, gate, up, down = (rng.normal(size=s) for s in ((d, e), (e, d, f), (e, d, f), (e, f, d)))
    given = np.stack([rng.choice(e, size=k, replace=False) for _ in range(n)]).astype(np.int32)
    logits = jnp.asarray(x @ router, jnp.float32)
    weights = gate_weights(logits, jax.nn.softmax(logits), jnp.asarray(given), routing=routing, normalize=normalize)
    x32, gate32, up32, down32 = (jnp.asarray(a, jnp.float32) for a in (x, gate, up, down))
    y = experts_dense(x32, weights, jnp.asarray(given), gate32, up32, down32, scale_input=routing == "sigmoid_topk")
    want = _numpy_replayed(x, router, gate, up, down, given, routing, normalize)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)


def test_mismatch_counts_by_hand():
    """4 tokens, k = 2: token 0 recorded {1, 0} = own {0, 1} (same set), token 1 recorded {2, 3} vs
    own {0, 1}, token 2 not recorded, token 3 recorded but masked out: 2 recorded, 1 mismatched."""
    probs = jnp.full((4, 4), 0.25)
    own = jnp.asarray([[0, 1], [0, 1], [0, 1], [0, 1]], jnp.int32)
    recorded = jnp.asarray([[1, 0], [2, 3], [-1, -1], [2, 3]], jnp.int32)
    stats = router_stats(probs, own, jnp.asarray([1.0, 1.0, 1.0, 0.0]), own, recorded)
    assert float(stats.recorded) == 2.0 and float(stats.mismatched) == 1.0


QWEN3_MOE = dict(moe_checkpoints.QWEN3_MOE_SMALL, num_hidden_layers=3, mlp_only_layers=[1])
LLAMA4 = dict(
    moe_checkpoints.LLAMA4_SMALL, num_hidden_layers=4, no_rope_layers=[1, 1, 0, 1], interleave_moe_layer_step=2
)


def _torch_model(kind):
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE))
    else:
        config = transformers.Llama4TextConfig(**LLAMA4)
        config._attn_implementation = "eager"
        model = transformers.Llama4ForCausalLM(config)
    moe_checkpoints.randomize_moe(model)
    return model.eval()


@pytest.mark.parametrize("kind", ["qwen3_moe", "llama4"])
def test_the_engine_records_the_experts_transformers_routes_to(tmp_path, kind):
    """For each generated token, the experts recorded for the input that produced it (the last
    prompt token, then each generated token) equal the top-k of transformers' router logits over
    the whole sequence at that position, in every MoE layer."""
    torch_model = _torch_model(kind)
    torch_model.save_pretrained(str(tmp_path), safe_serialization=True)
    model = hf.load_hf(str(tmp_path), dtype="float32")
    k = model.config.num_experts_per_tok
    prompts = [[5, 17, 3], [9, 2, 44, 61, 7, 120, 8, 30, 11, 4]]
    completions = generate(model, prompts, max_new_tokens=10, num_slots=2, chunk_size=4)
    for prompt, completion in zip(prompts, completions):
        recorded = completion.routed_experts
        assert recorded is not None and recorded.shape == (10, 2, k)  # two MoE layers in each config
        assert recorded.dtype == np.int8  # the batch's narrow dtype for a few experts
        sequence = torch.tensor([prompt + completion.tokens])
        with torch.no_grad():
            router_logits = torch_model(sequence, output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            want = torch.topk(logits.float(), k, dim=-1).indices.numpy()  # [T, k]
            fed = want[len(prompt) - 1 : len(prompt) - 1 + len(completion.tokens)]
            np.testing.assert_array_equal(np.sort(recorded[:, layer], -1), np.sort(fed, -1))


def _near_tie_model(eps: float):
    """tiny-qwen3-moe (float32, all layers MoE) routing each token to one expert, where in layer 0
    experts 0 and 1 have the largest router columns (10x), equal but for eps times a random
    direction: every token's choice between them is a near tie. Layer 0's experts are 5x the
    initialisation's scale, so the choice shows in the log-probs."""
    config = get_preset("tiny-qwen3-moe", scan_layers=False, num_experts_per_tok=1, norm_topk_prob=False)
    model = init_transformer(config, seed=3)
    assert not isinstance(model.layers, DecoderLayer)  # unscanned: a list of layers
    moe = model.layers[0].moe
    column = 10.0 * moe.router[...][:, 0]
    direction = jax.random.normal(jax.random.key(7), column.shape)
    moe.router[...] = moe.router[...].at[:, 0].set(column).at[:, 1].set(column + eps * direction)
    for weight in (moe.gate_proj, moe.up_proj, moe.down_proj):
        weight[...] = 5.0 * weight[...]
    return model


def _trainer_logprobs(model, tokens, recorded=None):
    hidden, stats = model.hidden_with_routing(tokens, jnp.ones(tokens.shape, jnp.float32), recorded=recorded)
    logp, _ = next_token_logprobs(model.head, hidden, tokens, temperature=1.0, chunk_size=64, with_entropy=False)
    return np.asarray(logp), stats


def _recorded_of(completion) -> jax.Array:
    """The completion's recorded experts [L, 1, P + n, k] at the trainer's positions: the first
    prompt token has none (the prompts are one token), the last token none (nothing fed it)."""
    recorded = jnp.asarray(completion.routed_experts, jnp.int32)[None].transpose(2, 0, 1, 3)  # [L, 1, n, k]
    return jnp.pad(recorded, ((0, 0), (0, 0), (0, 1), (0, 0)), constant_values=-1)


def _flipped_near_tie():
    """(model, completions, index) of a near tie (`_near_tie_model`) where the decode program and
    the full forward route some token of completion `index` differently. One-token prompts, so
    every position whose output scores a completion token was fed by a decode step and has
    recorded experts. Tries a few tie widths; fails the test if none flips."""
    for eps in (1e-8, 1e-7, 1e-6, 1e-5):
        model = _near_tie_model(eps)
        completions = generate(
            model, [[t] for t in range(1, 9)], max_new_tokens=24, num_slots=8, chunk_size=8, temperature=1.0
        )
        for index, completion in enumerate(completions):
            tokens = jnp.asarray([completion.prompt_tokens + completion.tokens])
            _, stats = _trainer_logprobs(model, tokens, recorded=_recorded_of(completion))
            assert stats is not None  # a mixture-of-experts policy
            if float(jnp.sum(stats.mismatched)) > 0:
                return model, completions, index
    pytest.fail("no near tie flipped between the decode program and the full forward")


def test_replay_makes_the_trainers_logprobs_equal_the_samplers_on_a_near_tie():
    """Where the routing flipped, the trainer's own log-probs differ from the sampler's, and with
    the recorded experts replayed they equal them."""
    model, completions, index = _flipped_near_tie()
    completion = completions[index]
    tokens = jnp.asarray([completion.prompt_tokens + completion.tokens])
    own, _ = _trainer_logprobs(model, tokens)
    replayed, _ = _trainer_logprobs(model, tokens, recorded=_recorded_of(completion))
    sampler = np.asarray(completion.logprobs)
    assert np.abs(own[0, 1:] - sampler).max() > 1e-2  # routing noise, not rounding
    np.testing.assert_allclose(replayed[0, 1:], sampler, atol=2e-5, rtol=0)


def test_the_train_step_replays_the_samplers_routing_on_a_near_tie():
    """The same near tie through the run's path: the completions as a train batch
    (`build_train_batch` with the sampler's routing) into the train step. The mismatch share is
    logged with and without replay; only with `router_replay` do the trainer's log-probs
    equal the sampler's (train/logp_mismatch_max, over every loss token of the batch)."""
    model, completions, _ = _flipped_near_tie()
    config = model.config
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    routing = Routing(moe_layers, config.num_experts_per_tok, config.num_experts)
    groups = [
        Group(i, Prompt(str(i), tuple(c.prompt_tokens)), 0, completions=(c,), rewards=np.asarray([i % 2], np.float32))
        for i, c in enumerate(completions)
    ]
    batch, _ = build_train_batch(groups, rows=8, length_buckets=(32,), zero_variance="none", routing=routing)
    graphdef, params = nnx.split(model)
    metrics = {}
    for replay in (False, True):
        step_config = TrainStepConfig(
            moe_layers=moe_layers,
            num_experts=config.num_experts,
            experts_per_token=config.num_experts_per_tok,
            router_replay=replay,
            logprob_chunk_size=64,
        )
        step = jax.jit(lambda p, b, c=step_config: accumulate_gradients(graphdef, p, b, c)[1])
        metrics[replay] = {name: float(value) for name, value in step(params, batch).items()}
    # Replayed, a later layer sees the sampler's inputs, so only its own disagreement counts;
    # without, layer 0's flips also move what the later layers see.
    assert 0 < metrics[True]["train/routing_mismatch_frac"] <= metrics[False]["train/routing_mismatch_frac"] < 0.5
    assert metrics[False]["train/logp_mismatch_max"] > 1e-2
    assert metrics[True]["train/logp_mismatch_max"] < 2e-5
