"""The train step on a mixture-of-experts policy (a random Qwen3-MoE built by transformers):
its routing metrics equal what transformers' router logits give over the same real tokens, and
the load-balancing loss enters the gradient as c times torch autograd's gradient of transformers'
`aux_loss` (the router weights' gradient, per layer)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from scalerl_jax.models import hf  # noqa: E402
from scalerl_jax.train import TrainStepConfig  # noqa: E402
from scalerl_jax.train.step import accumulate_gradients, routed_token_mask  # noqa: E402

EXPERTS, TOP_K, LAYERS = 8, 2, 2
# (prompt, completion) lengths per row; the rest of each row is padding. Row 3 is not valid.
ROWS = [(4, 6), (3, 9), (5, 2), (4, 4)]
LENGTH = 12


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        pad_token_id=0,
    )
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn_like(param))
    path = str(tmp_path_factory.mktemp("moe"))
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def _batch():
    rng = np.random.default_rng(0)
    tokens = np.zeros((len(ROWS), LENGTH), np.int32)
    loss_mask = np.zeros((len(ROWS), LENGTH), np.float32)
    for b, (prompt, completion) in enumerate(ROWS):
        tokens[b, : prompt + completion] = rng.integers(1, 128, prompt + completion)
        loss_mask[b, prompt : prompt + completion] = 1.0
    return {
        "tokens": tokens,
        "loss_mask": loss_mask,
        "behavior_logp": -loss_mask,
        "rewards": np.asarray([1.0, 0.0, 1.0, 0.0], np.float32),
        "group_ids": np.zeros(len(ROWS), np.int32),
        "sample_valid": np.asarray([True, True, True, False]),
    }


def test_routed_tokens_are_prompt_and_completion_of_valid_rows():
    batch = _batch()
    mask = np.asarray(routed_token_mask(jnp.asarray(batch["loss_mask"]), jnp.asarray(batch["sample_valid"])))
    want = np.zeros_like(mask)
    for b, (prompt, completion) in enumerate(ROWS[:3]):
        want[b, : prompt + completion] = 1.0
    np.testing.assert_array_equal(mask, want)


def test_routing_metrics_and_aux_gradient_equal_transformers(moe_checkpoint):
    path, torch_model = moe_checkpoint
    batch = _batch()
    model = hf.load_hf(path, dtype="float32")
    graphdef, params = nnx.split(model)
    base = TrainStepConfig(moe_layers=LAYERS, num_experts=EXPERTS)
    coef = 0.5

    def run(config):
        return jax.jit(lambda p, b: accumulate_gradients(graphdef, p, b, config))(params, batch)

    grads_without, metrics = run(base)
    grads_with, metrics_with = run(dataclasses.replace(base, router_aux_loss_coef=coef))

    # transformers over the same real tokens (the routed mask as its attention mask)
    mask = np.zeros((len(ROWS), LENGTH), np.float32)
    for b, (prompt, completion) in enumerate(ROWS[:3]):
        mask[b, : prompt + completion] = 1.0
    torch_model.zero_grad()
    out = torch_model(
        torch.tensor(batch["tokens"]).long(), attention_mask=torch.tensor(mask).long(), output_router_logits=True
    )
    out.aux_loss.backward()
    kept = mask.reshape(-1) > 0
    counts, entropies = [], []
    for logits in out.router_logits:
        probs = torch.softmax(logits.detach().double(), -1).numpy()[kept]
        top = np.argsort(-probs, axis=-1)[:, :TOP_K]
        counts.append(np.bincount(top.ravel(), minlength=EXPERTS))
        entropies.append(-(probs * np.log(probs)).sum(-1))
    assert float(metrics["moe/aux_loss"]) == pytest.approx(float(out.aux_loss.detach()), rel=1e-5)
    assert float(metrics["moe/tokens_per_expert_min"]) == np.min(counts)
    assert float(metrics["moe/tokens_per_expert_max"]) == np.max(counts)
    assert float(metrics["moe/router_entropy"]) == pytest.approx(np.mean(np.concatenate(entropies)), rel=1e-5)
    assert float(metrics["moe/dropped_tokens"]) == 0.0
    assert float(metrics_with["train/loss"]) == pytest.approx(float(metrics["train/loss"]), abs=1e-6)  # policy part

    router_grad = np.asarray(grads_with["layers"]["moe"]["router"][...] - grads_without["layers"]["moe"]["router"][...])
    for layer in range(LAYERS):
        torch_grad = torch_model.model.layers[layer].mlp.gate.weight.grad.double().numpy().T  # [D, E] as ours
        assert np.abs(torch_grad).max() > 1e-4  # the aux loss moves the router
        np.testing.assert_allclose(router_grad[layer], coef * torch_grad, rtol=1e-3, atol=1e-6)


def test_routing_mismatch_frac_counts_the_pairs_that_differ_from_transformers_routing(moe_checkpoint):
    """The sampler's routing taken from transformers' router top-k at every position, then changed
    by hand: 5 (token, layer) pairs of real tokens to the two least likely experts (a different
    set), 2 pairs cut to -1 (not recorded), and pairs of the invalid row and the padding changed
    too (not real tokens: not counted). train/routing_mismatch_frac = 5 / (recorded real pairs).
    Without replay the loss is that of the step without routing; replaying transformers' own
    routing leaves it (the same experts and gates), replaying the changed pairs moves the log-probs."""
    path, torch_model = moe_checkpoint
    batch = _batch()
    model = hf.load_hf(path, dtype="float32")
    graphdef, params = nnx.split(model)
    with torch.no_grad():
        router_logits = torch_model(torch.tensor(batch["tokens"]).long(), output_router_logits=True).router_logits
    order = np.stack([np.argsort(-logits.double().numpy(), axis=-1) for logits in router_logits])  # [L, B*T, E]
    order = order.reshape(LAYERS, len(ROWS), LENGTH, EXPERTS).transpose(1, 2, 0, 3)  # [B, T, L, E]
    routed = np.ascontiguousarray(order[..., :TOP_K]).astype(np.int8)
    real = np.zeros((len(ROWS), LENGTH), bool)
    for b, (prompt, completion) in enumerate(ROWS[:3]):
        real[b, : prompt + completion] = True
    changed = [(0, 1, 0), (0, 5, 1), (1, 0, 0), (1, 11, 1), (2, 6, 0)]  # (row, position, layer), real tokens
    unrecorded = [(0, 2, 1), (2, 3, 0)]
    elsewhere = [(3, 0, 0), (3, 7, 1), (0, 11, 0)]  # the invalid row 3, row 0's padding
    assert all(real[b, t] for b, t, _ in changed + unrecorded) and not any(real[b, t] for b, t, _ in elsewhere)
    replayed_own = routed.copy()
    for b, t, layer in changed + elsewhere:
        routed[b, t, layer] = order[b, t, layer, -TOP_K:]
    for b, t, layer in unrecorded:
        routed[b, t, layer] = -1
    base = TrainStepConfig(moe_layers=LAYERS, num_experts=EXPERTS)
    step = lambda config, b: jax.jit(lambda p: accumulate_gradients(graphdef, p, b, config)[1])(params)
    with_routing = dataclasses.replace(base, experts_per_token=TOP_K)
    replay = dataclasses.replace(with_routing, router_replay=True)
    plain = step(base, batch)
    logged = step(with_routing, {**batch, "routed_experts": routed})
    own = step(replay, {**batch, "routed_experts": replayed_own})
    moved = step(replay, {**batch, "routed_experts": routed})
    recorded_pairs = real.sum() * LAYERS - len(unrecorded)
    assert float(logged["train/routing_mismatch_frac"]) == pytest.approx(len(changed) / recorded_pairs, rel=1e-6)
    assert float(logged["moe/recorded_pairs"]) == recorded_pairs
    assert float(own["train/routing_mismatch_frac"]) == 0.0
    assert float(logged["train/loss"]) == pytest.approx(float(plain["train/loss"]), abs=1e-7)
    assert float(own["train/loss"]) == pytest.approx(float(plain["train/loss"]), abs=1e-7)
    # logp of every loss token after a replayed change moves (train/loss, weighted by small
    # advantages, moves less)
    assert abs(float(moved["train/logp_mismatch"]) - float(plain["train/logp_mismatch"])) > 1e-5
