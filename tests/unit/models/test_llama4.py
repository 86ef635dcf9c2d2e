"""Llama 4 text decoders built by transformers (random, a few hundred thousand parameters, no
download) against transformers: float32 logits, bfloat16 with the fp32 head, greedy tokens through
the sampler (chunked prefill, paged decode across a chunk boundary), the load -> export -> load
round trip, the image-text checkpoint's text decoder, and config.json files refused by name.

The configs make every Llama 4 feature matter on short sequences: chunks of 8 tokens, temperature
tuning every 4 positions, Llama 3 RoPE scaling with low = high frequency factor (as Scout ships),
a NoPE layer, interleaved dense and MoE layers, top-1 and top-2 sigmoid routing."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import moe_checkpoints  # noqa: E402  (tests/support)

from scalerl_jax.models import hf  # noqa: E402
from scalerl_jax.models.hf_tokenizer import CheckpointFileError  # noqa: E402
from scalerl_jax.models.layers import attention_temperature  # noqa: E402
from scalerl_jax.sampler import generate  # noqa: E402

VOCAB = moe_checkpoints.VOCAB
COMMON = moe_checkpoints.LLAMA4_SMALL
LLAMA4 = {
    # Layers 0, 1, 3 RoPE + chunked attention, layer 2 NoPE + full attention; MoE in layers 1 and 3.
    "interleaved": dict(num_hidden_layers=4, no_rope_layers=[1, 1, 0, 1], interleave_moe_layer_step=2),
    # The interleaved pattern twice: kinds repeat every 4 layers, so 4 stacks of 2 scanned.
    "periodic": dict(num_hidden_layers=8, no_rope_layers=[1, 1, 0, 1] * 2, interleave_moe_layer_step=2),
    # Two alike layers (RoPE, chunked, MoE, top-2): one scanned stack.
    "uniform": dict(num_hidden_layers=2, no_rope_layers=[1, 1], num_experts_per_tok=2),
}


_randomize = moe_checkpoints.randomize_moe


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{kind: (directory, torch model)} of Llama4ForCausalLM checkpoints."""
    root = tmp_path_factory.mktemp("llama4")
    torch.manual_seed(0)
    out = {}
    for kind, fields in LLAMA4.items():
        config = transformers.Llama4TextConfig(**COMMON, **fields)
        config._attn_implementation = "eager"
        model = transformers.Llama4ForCausalLM(config).eval()
        _randomize(model)
        path = str(root / kind)
        model.save_pretrained(path, safe_serialization=True)
        out[kind] = (path, model)
    return out


_tokens = moe_checkpoints.random_tokens


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.double().numpy()


def test_the_config_reads_every_layer_kind(checkpoints):
    config = hf.load_hf_config(checkpoints["interleaved"][0])
    assert (config.family, config.routing, config.num_experts_per_tok) == ("llama4", "sigmoid_topk", 1)
    assert config.nope_layers == (2,) and config.chunked_attention_layers == (0, 1, 3)
    assert config.dense_layers == (0, 2) and config.attention_chunk_size == 8
    assert (config.intermediate_size, config.moe_intermediate_size, config.shared_expert_intermediate_size) == (
        96,
        32,
        32,
    )
    assert config.qk_l2_norm and config.attn_temperature_tuning and not config.scan_layers
    assert hf.load_hf_config(checkpoints["uniform"][0]).scan_layers
    periodic = hf.load_hf_config(checkpoints["periodic"][0])
    assert periodic.scan_layers and periodic.layer_period == 4 and periodic.nope_layers == (2, 6)


def test_a_periodic_model_scans_one_period_per_step(checkpoints):
    """8 layers of period 4: 4 stacks of 2, one scan of 2 steps; the same hidden states, router
    statistics and replayed experts as the 8 layers unrolled (whose logits the parity tests check)."""
    from flax import nnx

    from scalerl_jax.models.transformer import DecoderLayer

    path = checkpoints["periodic"][0]
    scanned, unrolled = (hf.load_hf(path, dtype="float32", scan_layers=scan) for scan in (True, False))
    stacks = scanned.layers
    assert not isinstance(stacks, DecoderLayer)  # period 4: a list of 4 stacks
    assert [stack.attn.q_proj.shape[0] for stack in stacks] == [2, 2, 2, 2]
    tokens = jnp.asarray(_tokens())
    mask = jnp.ones(tokens.shape, jnp.float32)
    recorded = jax.random.randint(jax.random.key(0), (4, *tokens.shape, 1), -1, 4)  # [MoE layers, B, T, k]

    def forward(model, replay):
        return jax.jit(lambda m, t, r: m.hidden_with_routing(t, mask, recorded=r, replay=replay))(
            model, tokens, recorded
        )

    graphdef, state = nnx.split(scanned)
    jaxpr = str(jax.make_jaxpr(lambda s: nnx.merge(graphdef, s).hidden(tokens))(state))
    assert "length=2" in jaxpr and "length=8" not in jaxpr
    for replay in (False, True):
        (h_scan, stats_scan), (h_unrolled, stats_unrolled) = forward(scanned, replay), forward(unrolled, replay)
        np.testing.assert_allclose(np.asarray(h_scan), np.asarray(h_unrolled), atol=1e-5, rtol=0)
        for a, b in zip(stats_scan, stats_unrolled):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_attention_temperature_by_hand():
    """1 + 0.1 log(1 + floor((p + 1) / 8192)) at p = 0, 8190, 8191, 3 * 8192 - 1."""
    got = attention_temperature(jnp.array([0, 8190, 8191, 3 * 8192 - 1]), 8192.0, 0.1)
    want = [1.0, 1.0, 1.0 + 0.1 * np.log(2.0), 1.0 + 0.1 * np.log(4.0)]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


@pytest.mark.parametrize("kind", sorted(LLAMA4))
@pytest.mark.parametrize("moe_impl", ["dense", "ragged"])
def test_llama4_logits_match_transformers_in_float32(checkpoints, kind, moe_impl):
    path, torch_model = checkpoints[kind]
    model = hf.load_hf(path, dtype="float32", moe_impl=moe_impl)
    tokens = _tokens()
    logits = jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits), _torch_logits(torch_model, tokens), atol=1e-4, rtol=0)


def test_each_llama4_attention_feature_changes_the_logits(checkpoints):
    """The parity above could not hold with any one attention feature left out: each, switched off
    (none has parameters), moves the logits by far more than the parity's tolerance."""
    from flax import nnx

    path, torch_model = checkpoints["interleaved"]
    tokens = _tokens()
    want = _torch_logits(torch_model, tokens)
    graphdef, state = nnx.split(hf.load_hf(path, dtype="float32"))
    for change in (
        dict(chunked_attention_layers=()),
        dict(nope_layers=()),
        dict(qk_l2_norm=False),
        dict(attn_temperature_tuning=False),
    ):
        config = hf.load_hf_config(path, dtype="float32").replace(**change)
        other, _ = nnx.split(nnx.eval_shape(lambda config=config: hf.Transformer(config, rngs=nnx.Rngs(0))))
        gap = np.abs(np.asarray(nnx.merge(other, state)(jnp.asarray(tokens))) - want).max()
        assert gap > 1e-3, (change, gap)


def test_llama4_in_bfloat16_with_the_fp32_head_stays_near_float32(checkpoints):
    """bfloat16 body (float32 router and head) against transformers' float32: log-probs within
    bfloat16's reach at every position, except where transformers' own bfloat16 model is as far
    off (a top-1 expert choice that bfloat16 rounding flips; in this config one position of 40)."""
    path, torch_model = checkpoints["interleaved"]
    tokens = _tokens()
    model = hf.load_hf(path, dtype="bfloat16")
    logits = np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens)), np.float64)
    want = _torch_logits(torch_model, tokens)
    torch_bf16 = _torch_logits(copy.deepcopy(torch_model).to(torch.bfloat16), tokens)

    def log_probs(x):
        top = x.max(-1, keepdims=True)
        return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))

    gap = np.abs(log_probs(logits) - log_probs(want)).max(-1)  # [B, T]
    torch_gap = np.abs(log_probs(torch_bf16) - log_probs(want)).max(-1)
    assert np.median(gap) < 0.02, np.median(gap)
    assert np.all((gap < 0.1) | (torch_gap > 0.25)), (gap, torch_gap)
    assert np.mean(gap < 0.1) >= 0.95


@pytest.mark.parametrize("kind", sorted(LLAMA4))
def test_greedy_tokens_through_the_sampler_equal_transformers_generate(checkpoints, kind):
    """Prompts of 3 to 13 tokens and 12 new ones: decode crosses the 8-token chunk boundary and the
    temperature's 4-position steps in the paged cache."""
    path, torch_model = checkpoints[kind]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB, size=n).tolist() for n in (3, 13, 6)]
    ours = generate(hf.load_hf(path, dtype="float32"), prompts, max_new_tokens=12, num_slots=2, chunk_size=4)
    for prompt, completion in zip(prompts, ours):
        assert completion.tokens == moe_checkpoints.transformers_greedy(torch_model, prompt, 12), prompt


@pytest.mark.parametrize("kind", sorted(LLAMA4))
def test_llama4_export_loads_in_transformers_and_back(checkpoints, tmp_path, kind):
    path, torch_model = checkpoints[kind]
    tokens = _tokens()
    out_dir = str(tmp_path / "export")
    hf.save_hf(hf.load_hf(path, dtype="float32"), out_dir)
    assert set(_tensor_names(out_dir)) == set(_tensor_names(path))  # fused experts, as transformers writes
    reloaded = transformers.Llama4ForCausalLM.from_pretrained(out_dir, attn_implementation="eager").eval()
    np.testing.assert_allclose(_torch_logits(reloaded, tokens), _torch_logits(torch_model, tokens), atol=1e-6, rtol=0)
    again = hf.load_hf(out_dir, dtype="float32")
    np.testing.assert_allclose(
        np.asarray(again(jnp.asarray(tokens))), _torch_logits(torch_model, tokens), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("kind", sorted(LLAMA4))
def test_parameter_count_equals_transformers(checkpoints, kind):
    path, torch_model = checkpoints[kind]
    assert hf.load_hf_config(path).num_params() == sum(p.numel() for p in torch_model.parameters())


def test_the_image_text_checkpoint_loads_its_text_decoder(tmp_path):
    """A Llama4ForConditionalGeneration as transformers writes it (and as Scout ships): the text
    decoder under `language_model.`, its config under `text_config`, a vision tower beside it."""
    torch.manual_seed(1)
    text = dict(COMMON, **LLAMA4["interleaved"])
    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=28,
        patch_size=14,
        vision_output_dim=64,
        projector_input_dim=64,
        projector_output_dim=64,
    )
    model = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text, vision_config=vision)
    ).eval()
    model.config.text_config._attn_implementation = "eager"
    _randomize(model)
    path = str(tmp_path / "image_text")
    model.save_pretrained(path, safe_serialization=True)
    assert any(name.startswith("vision_model.") for name in _tensor_names(path))
    ours = hf.load_hf(path, dtype="float32")
    assert ours.config.family == "llama4" and ours.config.nope_layers == (2,)
    tokens = _tokens()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), _torch_logits(model, tokens), atol=1e-4, rtol=0)


_tensor_names = moe_checkpoints.tensor_names


_rewrite_config = moe_checkpoints.rewrite_config


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda c: c.update(routing_mode="softmax"), "'routing_mode'"),
        (lambda c: c.update(router_jitter_noise=0.1), "'router_jitter_noise'"),
        (lambda c: c.update(layer_types=["sliding_attention"] * 4), "sliding_attention"),
        (lambda c: c.update(no_rope_layers=[1, 0]), "'no_rope_layers'"),
        (lambda c: c.pop("num_local_experts"), "'num_local_experts'"),
    ],
    ids=["unknown field", "jitter", "layer type", "short no_rope_layers", "no experts"],
)
def test_a_llama4_config_this_loader_cannot_honour_is_refused_by_name(checkpoints, tmp_path, edit, named):
    path = str(tmp_path / "edited")
    _rewrite_config(checkpoints["interleaved"][0], path, edit)
    with pytest.raises(CheckpointFileError, match=named):
        hf.load_hf(path, dtype="float32")


@pytest.mark.parametrize("kind", sorted(LLAMA4))
def test_cached_prefill_and_decode_equal_the_full_forward(checkpoints, kind):
    """An 11-token prefill (crossing the first 8-token chunk) then one token at a time through the
    stacked KV cache, read in blocks of 4: each step's logits equal the full forward's at that position."""
    from scalerl_jax.models.transformer import init_kv_cache

    model = hf.load_hf(checkpoints[kind][0], dtype="float32")
    tokens = jnp.asarray(_tokens())
    full = np.asarray(model(tokens))
    cache = init_kv_cache(model.config, 2, 24)
    prefill = 11
    positions = jnp.broadcast_to(jnp.arange(prefill), (2, prefill))
    hidden, cache = model.forward_cached(tokens[:, :prefill], positions, cache)
    np.testing.assert_allclose(np.asarray(model.head(hidden)), full[:, :prefill], atol=1e-4, rtol=0)
    for t in range(prefill, tokens.shape[1]):
        step = jnp.full((2, 1), t, jnp.int32)
        hidden, cache = model.forward_cached(tokens[:, t : t + 1], step, cache, window=24, block=4)
        np.testing.assert_allclose(np.asarray(model.head(hidden))[:, 0], full[:, t], atol=1e-4, rtol=0)
