"""Mixture-of-experts policies: the MoE block against a numpy loop over tokens and experts, and
Qwen3-MoE checkpoints built by transformers (random, a few hundred thousand parameters, no
download) against transformers: logits in float32 and bfloat16, greedy tokens through the sampler,
the load -> export -> load round trip, the parameter count, and config.json files refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import moe_checkpoints  # noqa: E402  (tests/support)

from scalerl_jax.models import hf  # noqa: E402
from scalerl_jax.models.hf_tokenizer import CheckpointFileError  # noqa: E402
from scalerl_jax.models.moe import (  # noqa: E402
    experts_dense,
    experts_ragged,
    load_balancing_loss,
    route_softmax_topk,
    router_stats,
)
from scalerl_jax.sampler import generate  # noqa: E402

VOCAB = moe_checkpoints.VOCAB
COMMON = moe_checkpoints.QWEN3_MOE_SMALL
# 'mixed': layer 1 keeps a dense MLP (mlp_only_layers), top-k renormalized; 'sparse': every layer
# has experts (one scanned stack), top-k probabilities as they are.
QWEN3_MOE = {
    "mixed": dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True),
    "sparse": dict(num_hidden_layers=2, norm_topk_prob=False),
}


def _numpy_moe(x, router, gate, up, down, k, normalize):
    """y[n] = sum over the top-k experts of softmax(x W_r) of w_e * SwiGLU_e(x[n]), token by token."""
    out = np.zeros_like(x)
    for n, token in enumerate(x):
        logits = token @ router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:k]
        weights = probs[top] / (probs[top].sum() if normalize else 1.0)
        for w, e in zip(weights, top):
            g, u = token @ gate[e], token @ up[e]
            out[n] += w * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("compute", [experts_dense, experts_ragged], ids=["dense", "ragged"])
def test_moe_block_equals_a_numpy_loop(compute, normalize):
    rng = np.random.default_rng(0)
    n, d, e, f, k = 40, 16, 6, 8, 2
    x = rng.normal(size=(n, d))
    router, gate, up, down = (rng.normal(size=s) for s in ((d, e), (e, d, f), (e, d, f), (e, f, d)))
    weights, experts = route_softmax_topk(jax.nn.softmax(jnp.asarray(x @ router, jnp.float32)), k, normalize)
    assert experts.dtype == jnp.int32 and len(set(np.asarray(experts).ravel().tolist())) == e  # every expert used
    x, gate, up, down = (jnp.asarray(a, jnp.float32) for a in (x, gate, up, down))
    y = jax.jit(compute)(x, weights, experts, gate, up, down)
    x64, gate64, up64, down64 = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    want = _numpy_moe(x64, router, gate64, up64, down64, k, normalize)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{kind: (directory, torch model)}: random weights, router and norm scales included (a zero
    router, transformers' initialisation, would tie every expert)."""
    root = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(0)
    out = {}
    for kind, fields in QWEN3_MOE.items():
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**COMMON, **fields)).eval()
        moe_checkpoints.randomize_moe(model)
        path = str(root / kind)
        model.save_pretrained(path, safe_serialization=True)
        out[kind] = (path, model)
    return out


_tokens = moe_checkpoints.random_tokens


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.double().numpy()


@pytest.mark.parametrize("kind", sorted(QWEN3_MOE))
@pytest.mark.parametrize("moe_impl", ["dense", "ragged"])
def test_qwen3_moe_logits_match_transformers_in_float32(checkpoints, kind, moe_impl):
    path, torch_model = checkpoints[kind]
    model = hf.load_hf(path, dtype="float32", moe_impl=moe_impl)
    assert model.config.scan_layers == (kind == "sparse")  # a mix of layer kinds is not one stack
    assert model.config.dense_layers == ((1,) if kind == "mixed" else ())
    tokens = _tokens()
    logits = jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits), _torch_logits(torch_model, tokens), atol=1e-4, rtol=0)


def test_qwen3_moe_in_bfloat16_with_the_fp32_head_stays_near_float32(checkpoints):
    """bfloat16 body (float32 router and head): log-probs within bfloat16's reach of transformers' float32."""
    path, torch_model = checkpoints["mixed"]
    tokens = _tokens()
    model = hf.load_hf(path, dtype="bfloat16")
    logits = np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)), np.float64)
    assert model.config.fp32_head and logits.dtype == np.float64
    want = _torch_logits(torch_model, tokens)
    ours_lp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    want_lp = (
        want - np.log(np.exp(want - want.max(-1, keepdims=True)).sum(-1, keepdims=True)) - want.max(-1, keepdims=True)
    )
    gap = np.abs(ours_lp - want_lp)
    assert np.median(gap) < 0.02 and gap.max() < 0.25, (np.median(gap), gap.max())


@pytest.mark.parametrize("kind", sorted(QWEN3_MOE))
def test_qwen3_moe_export_loads_in_transformers_and_back(checkpoints, tmp_path, kind):
    path, torch_model = checkpoints[kind]
    tokens = _tokens()
    out_dir = str(tmp_path / "export")
    hf.save_hf(hf.load_hf(path, dtype="float32"), out_dir)
    shipped = set(_tensor_names(path))
    assert set(_tensor_names(out_dir)) == shipped  # the same tensors, one per expert, as transformers writes
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(out_dir).eval()
    np.testing.assert_allclose(_torch_logits(reloaded, tokens), _torch_logits(torch_model, tokens), atol=1e-6, rtol=0)
    again = hf.load_hf(out_dir, dtype="float32")
    np.testing.assert_allclose(
        np.asarray(again(jnp.asarray(tokens))), _torch_logits(torch_model, tokens), atol=1e-4, rtol=0
    )


_tensor_names = moe_checkpoints.tensor_names


@pytest.mark.parametrize("kind", sorted(QWEN3_MOE))
def test_parameter_count_equals_transformers(checkpoints, kind):
    path, torch_model = checkpoints[kind]
    assert hf.load_hf_config(path).num_params() == sum(p.numel() for p in torch_model.parameters())


def test_greedy_tokens_through_the_sampler_equal_transformers_generate(checkpoints):
    path, torch_model = checkpoints["mixed"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB, size=n).tolist() for n in (3, 9, 5)]
    ours = generate(hf.load_hf(path, dtype="float32"), prompts, max_new_tokens=8, num_slots=2, chunk_size=4)
    for prompt, completion in zip(prompts, ours):
        assert completion.tokens == moe_checkpoints.transformers_greedy(torch_model, prompt, 8), prompt


_rewrite_config = moe_checkpoints.rewrite_config


def test_config_files_that_are_not_what_the_loader_knows_are_refused_by_field(checkpoints, tmp_path):
    path, _ = checkpoints["mixed"]
    _rewrite_config(path, str(tmp_path / "routing"), lambda c: c.update(router_scoring="sigmoid"))
    with pytest.raises(CheckpointFileError, match="field 'router_scoring' is not one this loader knows for qwen3_moe"):
        hf.load_hf(str(tmp_path / "routing"))
    _rewrite_config(path, str(tmp_path / "dense"), lambda c: c.update(model_type="qwen3"))
    with pytest.raises(
        CheckpointFileError, match="model_type='qwen3' with mixture-of-experts field 'num_local_experts'"
    ):
        hf.load_hf(str(tmp_path / "dense"))
    with pytest.raises(ValueError, match="cannot be stacked for scan_layers; set scan_layers=False"):
        hf.load_hf(path, scan_layers=True)


@pytest.mark.parametrize("kind", sorted(QWEN3_MOE))
def test_router_stats_give_transformers_load_balancing_loss_and_the_router_entropy(checkpoints, kind):
    path, torch_model = checkpoints[kind]
    tokens = _tokens(batch=3, length=16, seed=1)
    mask = np.ones(tokens.shape, np.float32)
    mask[1, 11:] = 0  # padding: left out of every statistic, as transformers' attention_mask does
    mask[2, 5:] = 0
    model = hf.load_hf(path, dtype="float32")
    _, stats = jax.jit(lambda m, t, k: m.hidden_with_routing(t, k))(model, jnp.asarray(tokens), jnp.asarray(mask))
    with torch.no_grad():
        out = torch_model(torch.tensor(tokens), attention_mask=torch.tensor(mask).long(), output_router_logits=True)
    assert float(load_balancing_loss(stats)) == pytest.approx(float(out.aux_loss), rel=1e-5)
    moe_layers = len(out.router_logits)
    kept = mask.reshape(-1) > 0
    assert stats.expert_tokens.shape == (moe_layers, 8) and stats.tokens.shape == (moe_layers,)
    np.testing.assert_allclose(np.asarray(stats.expert_tokens).sum(-1), kept.sum() * 2)  # k = 2 choices per token
    for layer, logits in enumerate(out.router_logits):
        probs = torch.softmax(logits.double(), -1).numpy()[kept]
        assert float(stats.entropy[layer]) == pytest.approx(-(probs * np.log(probs)).sum(), rel=1e-5)
    assert float(np.asarray(stats.dropped).sum()) == 0.0


def test_a_choice_naming_no_expert_counts_as_dropped():
    probs = jnp.full((3, 4), 0.25)
    experts = jnp.asarray([[0, 1], [2, 4], [3, -1]], jnp.int32)  # 4 and -1 name no expert of 4
    stats = router_stats(probs, experts, jnp.asarray([1.0, 1.0, 0.0]))  # the third token masked out
    assert float(stats.dropped) == 1.0 and np.asarray(stats.expert_tokens).tolist() == [1, 1, 1, 0]
