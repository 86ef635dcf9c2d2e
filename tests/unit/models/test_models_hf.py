"""Model numerics against Hugging Face transformers (torch, CPU) as the independent reference.

Tiny random LlamaForCausalLM (Llama 3.1 rope scaling), Qwen2ForCausalLM (qkv bias) and
Qwen3ForCausalLM (q/k norm, tied embeddings) are built by transformers, saved with
`save_pretrained(safe_serialization=True)` and loaded with `load_hf`.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from scalerl_jax.models import hf, init_kv_cache, sequence_logprobs  # noqa: E402
from scalerl_jax.models.logprobs import chunked_head_logprobs  # noqa: E402
from scalerl_jax.models.transformer import DecoderLayer  # noqa: E402

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
# Llama 3.1 scaling with a small original context so that, with head_dim 16 and theta 1e4, the
# frequencies fall in all three bands (kept: wavelength < 16, interpolated, divided by 8: > 64).
LLAMA_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _hf_models():
    return {
        "llama": (
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA_ROPE, rms_norm_eps=1e-5),
        ),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**COMMON, rms_norm_eps=1e-6)),
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**COMMON, tie_word_embeddings=True)),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (directory, torch model)} with random weights (norm scales and biases perturbed too)."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {}
    for family, (cls, config) in _hf_models().items():
        model = cls(config).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or "bias" in name:
                    param.add_(0.1 * torch.randn_like(param))
        path = str(root / family)
        model.save_pretrained(path, safe_serialization=True)
        out[family] = (path, model)
    return out


def _tokens(batch=2, length=24, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (batch, length))


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.double().numpy()


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("family,scan", [("llama", True), ("llama", False), ("qwen2", True), ("qwen3", False)])
def test_load_hf_logits_match_transformers(checkpoints, family, scan):
    path, torch_model = checkpoints[family]
    tokens = _tokens()
    model = hf.load_hf(path, dtype="float32", scan_layers=scan)
    logits = jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens))
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), _torch_logits(torch_model, tokens), atol=1e-4, rtol=0)


def test_llama_rope_scaling_is_exercised(checkpoints):
    """Dropping the Llama 3.1 rope scaling changes the logits (so the parity test above checks it)."""
    path, torch_model = checkpoints["llama"]
    tokens = _tokens()
    unscaled = hf.load_hf(path, dtype="float32", rope_scaling=None)
    diff = np.abs(np.asarray(unscaled(jnp.asarray(tokens))) - _torch_logits(torch_model, tokens)).max()
    assert diff > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_save_hf_roundtrip_through_transformers(checkpoints, tmp_path, family):
    path, torch_model = checkpoints[family]
    cls = _hf_models()[family][0]
    tokens = _tokens()
    out_dir = str(tmp_path / "export")
    hf.save_hf(hf.load_hf(path, dtype="float32"), out_dir)
    reloaded = cls.from_pretrained(out_dir).eval()
    np.testing.assert_allclose(_torch_logits(reloaded, tokens), _torch_logits(torch_model, tokens), atol=1e-5, rtol=0)


def test_sharded_export_with_index_reloads(checkpoints, tmp_path):
    path, torch_model = checkpoints["qwen2"]
    out_dir = str(tmp_path / "sharded")
    hf.save_hf(hf.load_hf(path, dtype="float32", scan_layers=False), out_dir, max_shard_bytes=100_000)
    index = json.load(open(os.path.join(out_dir, hf.SAFETENSORS_INDEX)))
    assert len(set(index["weight_map"].values())) > 2
    tokens = _tokens()
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(out_dir).eval()
    np.testing.assert_allclose(_torch_logits(reloaded, tokens), _torch_logits(torch_model, tokens), atol=1e-5, rtol=0)
    ours = hf.load_hf(out_dir, dtype="float32")
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), _torch_logits(torch_model, tokens), atol=1e-4)


def test_forward_cached_prefill_then_decode_matches_transformers(checkpoints):
    """Ragged rows: row 0 has a 7-token prompt, row 1 a 4-token prompt (prefilled with garbage after
    it, which decoding overwrites); then each row decodes one token per step at its own position.
    Every step's logits equal transformers' full forward over that row's true prefix."""
    path, torch_model = checkpoints["llama"]
    model = hf.load_hf(path, dtype="float32")
    full = _tokens(batch=2, length=12, seed=3)
    prompt_lens = np.array([7, 4])
    expected = _torch_logits(torch_model, full)
    cache = init_kv_cache(model.config, batch=2, max_len=16)
    prefill_len = 8
    prompt = full[:, :prefill_len].copy()
    prompt[1, prompt_lens[1] :] = 5  # padding garbage beyond row 1's prompt
    positions = np.broadcast_to(np.arange(prefill_len), (2, prefill_len))
    step = jax.jit(lambda m, t, p, c: m.forward_cached(t, p, c))
    hidden, cache = step(model, jnp.asarray(prompt), jnp.asarray(positions), cache)
    logits = np.asarray(model.head(hidden))
    for row in range(2):
        n = prompt_lens[row]
        np.testing.assert_allclose(logits[row, :n], expected[row, :n], atol=1e-4, rtol=0)
    pos = prompt_lens.copy()
    decode = jax.jit(lambda m, t, p, c: m.forward_cached(t, p, c))
    for _ in range(4):
        tok = full[np.arange(2), pos][:, None]
        hidden, cache = decode(model, jnp.asarray(tok), jnp.asarray(pos[:, None]), cache)
        logits = np.asarray(model.head(hidden))[:, 0]
        np.testing.assert_allclose(logits, expected[np.arange(2), pos], atol=1e-4, rtol=0)
        pos += 1


def test_forward_cached_out_of_range_position_leaves_cache_untouched(checkpoints):
    path, _ = checkpoints["qwen3"]
    model = hf.load_hf(path, dtype="float32", scan_layers=False)
    max_len = 6
    cache = init_kv_cache(model.config, batch=2, max_len=max_len)
    cache = {k: v + 0.5 for k, v in cache.items()}  # non-zero so an overwrite would show
    tokens = jnp.asarray([[3], [4]])
    step = jax.jit(lambda m, t, p, c: m.forward_cached(t, p, c))
    for bad in (max_len, max_len + 3, -1):
        _, new = step(model, tokens, jnp.asarray([[2], [bad]]), cache)
        for name in ("k", "v"):
            np.testing.assert_array_equal(np.asarray(new[name][:, 1]), np.asarray(cache[name][:, 1]))
            changed = np.any(np.asarray(new[name][:, 0]) != np.asarray(cache[name][:, 0]), axis=(0, 2, 3))
            np.testing.assert_array_equal(changed, np.arange(max_len) == 2)  # only row 0, position 2


@pytest.mark.parametrize("chunk_size", [7, 64])
def test_sequence_logprobs_and_entropy_match_transformers(checkpoints, chunk_size):
    path, torch_model = checkpoints["qwen2"]
    model = hf.load_hf(path, dtype="float32")
    tokens = _tokens(batch=3, length=20, seed=5)
    temperature = 0.7
    logp, entropy = jax.jit(
        lambda m, t: sequence_logprobs(m, t, temperature=temperature, chunk_size=chunk_size, return_entropy=True)
    )(model, jnp.asarray(tokens))
    ref = _log_softmax(_torch_logits(torch_model, tokens) / temperature)  # [B, T, V] float64
    ref_logp = np.take_along_axis(ref[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    ref_entropy = -(np.exp(ref[:, :-1]) * ref[:, :-1]).sum(-1)
    assert logp.shape == tokens.shape and logp.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(logp[:, 0]), 0.0)
    np.testing.assert_allclose(np.asarray(logp[:, 1:]), ref_logp, atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(entropy[:, 1:]), ref_entropy, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "scan,remat",
    [
        pytest.param(True, "none", marks=pytest.mark.slow),
        (True, "full"),
        pytest.param(False, "dots", marks=pytest.mark.slow),
    ],
)
def test_logprob_gradients_match_torch_autograd(checkpoints, scan, remat):
    """d/dparams sum_t log p(tokens_t) equals torch autograd through the transformers model."""
    path, torch_model = checkpoints["llama"]
    tokens = _tokens(batch=2, length=16, seed=7)
    model = hf.load_hf(path, dtype="float32", scan_layers=scan, remat_policy=remat)
    graphdef, params = nnx.split(model)

    def objective(p):
        return jnp.sum(sequence_logprobs(nnx.merge(graphdef, p), jnp.asarray(tokens), chunk_size=5))

    grads = jax.jit(jax.grad(objective))(params)
    torch_model.zero_grad()
    logits = torch_model(torch.tensor(tokens)).logits
    torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, torch.tensor(tokens)[:, 1:, None]).sum().backward()
    torch_grads = {n: p.grad.double().numpy() for n, p in torch_model.named_parameters()}
    layer = lambda tree, i: tree[i] if not scan else tree  # noqa: E731
    for i in range(2):
        q = layer(grads["layers"], i)["attn"]["q_proj"][...]
        q = np.asarray(q[i] if scan else q)
        ref_q = torch_grads[f"model.layers.{i}.self_attn.q_proj.weight"].T.reshape(q.shape)
        np.testing.assert_allclose(q, ref_q, atol=1e-4 * np.abs(ref_q).max() + 1e-6)
        down = np.asarray(layer(grads["layers"], i)["mlp"]["down_proj"][...])
        down = down[i] if scan else down
        ref_down = torch_grads[f"model.layers.{i}.mlp.down_proj.weight"].T
        np.testing.assert_allclose(down, ref_down, atol=1e-4 * np.abs(ref_down).max() + 1e-6)
    ref_embed = torch_grads["model.embed_tokens.weight"]
    np.testing.assert_allclose(np.asarray(grads["embed_tokens"][...]), ref_embed, atol=1e-4 * np.abs(ref_embed).max())
    ref_head = torch_grads["lm_head.weight"].T
    np.testing.assert_allclose(np.asarray(grads["lm_head"][...]), ref_head, atol=1e-4 * np.abs(ref_head).max())


def test_fp32_head_reduces_mismatch_between_two_body_computations(checkpoints, tmp_path):
    """bf16 weights; two computations of the same hidden states that differ by accumulation order
    and precision (the bf16 body, and the same bf16 weights run in float32 then rounded to bf16:
    a stand-in for the generator's and the trainer's different kernels). Log-probs computed from
    the two through the same head differ less with the FP32 head than with a bf16 head.
    (On CPU, batch 1 vs 8, chunked vs unchunked and cached decode vs full forward give bitwise
    identical bf16 hidden states, so they cannot show the effect here.) The final norm scale is
    set to 30 so that logits have a trained model's spread (std ~5 instead of ~0.15)."""
    path, _ = checkpoints["llama"]
    scaled = tmp_path / "scaled"
    _rewrite(path, scaled, lambda t: {**t, "model.norm.weight": np.full(64, 30.0, np.float32)})
    tokens = jnp.asarray(_tokens(batch=4, length=48, seed=11))
    mismatch = {}
    for fp32_head in (True, False):
        bf16_model = hf.load_hf(str(scaled), dtype="bfloat16", fp32_head=fp32_head)
        graphdef, params = nnx.split(hf.load_hf(str(scaled), dtype="float32", fp32_head=fp32_head))
        upcast = nnx.merge(graphdef, jax.tree.map(lambda b, f: b.astype(f.dtype), nnx.state(bf16_model), params))
        hidden_a = bf16_model.hidden(tokens)
        hidden_b = upcast.hidden(tokens).astype(jnp.bfloat16)

        def logprobs(hidden):
            return chunked_head_logprobs(
                bf16_model.head, hidden[:, :-1], tokens[:, 1:], temperature=1.0, chunk_size=16, with_entropy=False
            )[0]

        mismatch[fp32_head] = float(jnp.mean(jnp.abs(logprobs(hidden_a) - logprobs(hidden_b))))
    print(f"mean |logp_a - logp_b|: fp32 head {mismatch[True]:.4f}, bf16 head {mismatch[False]:.4f}")
    assert 0.0 < mismatch[True] < mismatch[False]


def test_load_hf_onto_mesh_shards_each_param(checkpoints):
    path, torch_model = checkpoints["llama"]
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets XLA_FLAGS)")
    from scalerl_jax.models import make_mesh

    mesh = make_mesh((1, 4, 2))
    model = hf.load_hf(path, dtype="float32", mesh=mesh)
    assert isinstance(model.layers, DecoderLayer)  # scan_layers: one stacked layer
    q = model.layers.attn.q_proj[...]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    shard_shapes = {s.data.shape for s in q.addressable_shards}
    assert shard_shapes == {(2, 16, 2, 16)}  # [layers, embed/4, heads/2, head_dim]
    tokens = _tokens()
    logits = jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits), _torch_logits(torch_model, tokens), atol=1e-4, rtol=0)


def _rewrite(src_dir, dst_dir, edit):
    os.makedirs(dst_dir)
    tensors = safetensors.numpy.load_file(os.path.join(src_dir, "model.safetensors"))
    safetensors.numpy.save_file(edit(tensors), os.path.join(dst_dir, "model.safetensors"))
    with open(os.path.join(src_dir, "config.json")) as f, open(os.path.join(dst_dir, "config.json"), "w") as g:
        g.write(f.read())


def test_load_hf_errors_name_the_tensor(checkpoints, tmp_path):
    path, _ = checkpoints["llama"]
    missing = "model.layers.1.mlp.up_proj.weight"
    _rewrite(path, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != missing})
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        hf.load_hf(str(tmp_path / "missing"))
    _rewrite(path, tmp_path / "extra", lambda t: {**t, "model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        hf.load_hf(str(tmp_path / "extra"))
    bad = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(path, tmp_path / "shape", lambda t: {**t, bad: np.zeros((16, 64), np.float32)})
    with pytest.raises(ValueError, match=bad.replace(".", r"\.") + r".*\(16, 64\)"):
        hf.load_hf(str(tmp_path / "shape"))


def test_load_hf_refuses_pickled_weights(checkpoints, tmp_path):
    path, _ = checkpoints["llama"]
    os.makedirs(tmp_path / "pickled")
    with open(os.path.join(path, "config.json")) as f, open(tmp_path / "pickled" / "config.json", "w") as g:
        g.write(f.read())
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickled weights.*pytorch_model.bin"):
        hf.load_hf(str(tmp_path / "pickled"))


def test_load_tokenizer_and_chat_template(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<think>": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    loaded = hf.load_tokenizer(str(tmp_path))
    assert loaded.encode("hello world <think> zzz").ids == [1, 2, 3, 0]
    assert hf.load_chat_template(str(tmp_path)) == template
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert fast.encode("hello world") == loaded.encode("hello world").ids
