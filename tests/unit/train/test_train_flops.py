"""Model FLOP counts: a hand calculation for Llama 3.1 8B, and XLA's own count of a gradient."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from scalerl_jax.models import Transformer, get_preset
from scalerl_jax.train import matmul_params, train_flops_per_token, train_step_flops
from scalerl_jax.train.flops import devices_peak_flops_per_s, peak_bf16_flops_per_s


def test_llama31_8b_by_hand():
    # Per layer: q,o 2*4096*4096 = 33,554,432; k,v 2*4096*1024 = 8,388,608;
    # MLP 3*4096*14336 = 176,160,768; sum 218,103,808; x 32 = 6,979,321,856;
    # head 4096*128256 = 525,336,576; N = 7,504,658,432.
    config = get_preset("llama3.1-8b")
    assert matmul_params(config) == 7_504_658_432
    # T = 8192: 6N = 45,027,950,592; attention 6*32*32*128*8193 = 6,443,237,376.
    assert train_flops_per_token(config, 8192) == 45_027_950_592 + 6_443_237_376
    assert train_step_flops(config, 2, 8192) == 2 * 8192 * (45_027_950_592 + 6_443_237_376)


def test_matches_xla_cost_analysis_of_a_gradient():
    """XLA's FLOP count of grad(sum logits^2) on one sequence. XLA's attention computes the full
    T x T square and masks it, so it also spends 6 L h e T (T - 1) on the masked half, which the
    causal model count leaves out; elementwise ops add a little more (< 2% here)."""
    config = get_preset(
        "tiny-llama",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=1024,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        scan_layers=False,
    )
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    seq_len = 64
    loss = lambda p, t: jnp.sum(nnx.merge(graphdef, p)(t) ** 2)
    compiled = jax.jit(jax.grad(loss)).lower(params, jnp.zeros((1, seq_len), jnp.int32)).compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    if not analysis or "flops" not in analysis:
        pytest.skip("this backend reports no cost analysis")
    masked_half = 6 * config.num_layers * config.num_heads * config.head_dim * seq_len * (seq_len - 1)
    want = train_step_flops(config, 1, seq_len) + masked_half
    assert analysis["flops"] == pytest.approx(want, rel=0.02)


class _Device:
    def __init__(self, device_kind):
        self.device_kind = device_kind


def test_peak_flops_by_device_kind():
    """Data-sheet peaks (dense bf16) for the device_kind strings JAX reports."""
    assert peak_bf16_flops_per_s("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops_per_s("NVIDIA H200") == 989e12
    assert peak_bf16_flops_per_s("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops_per_s("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops_per_s("TPU v5 lite") == 197e12
    assert peak_bf16_flops_per_s("cpu") is None
    assert devices_peak_flops_per_s([_Device("NVIDIA H200")] * 4) == 4 * 989e12
    assert devices_peak_flops_per_s([_Device("NVIDIA H200"), _Device("cpu")]) is None
    assert devices_peak_flops_per_s(jax.devices("cpu")) is None
