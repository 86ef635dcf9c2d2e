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


def test_llama4_scout_by_hand():
    """Active parameters and chunked attention of the Scout text decoder (48 layers, all MoE)."""
    # Per layer: q,o 2*5120*5120 = 52,428,800; k,v 2*5120*1024 = 10,485,760; router 5120*16 = 81,920;
    # one routed expert and the shared one 2*3*5120*8192 = 251,658,240; sum 314,654,720;
    # x 48 = 15,103,426,560; head 5120*202048 = 1,034,485,760; N = 16,137,912,320 (+ the embedding
    # lookup's 1,034,485,760: 17.17e9, Meta's "17B active parameters").
    config = get_preset("llama4-scout")
    assert matmul_params(config) == 16_137_912_320
    # T = 16384 = 2 chunks of 8192: 36 chunked layers attend 2*8192*8193/2 = 67,117,056 keys, the 12
    # NoPE layers 16384*16385/2 = 134,225,920; 12*40*128 = 61,440 FLOPs per key, over T tokens.
    keys = 36 * 67_117_056 + 12 * 134_225_920
    assert train_flops_per_token(config, 16384) == 6 * 16_137_912_320 + 61_440 * keys / 16384
    # Within one chunk the chunked layers are full causal ones: 6 L h e (T + 1).
    assert train_flops_per_token(config, 100) == 6 * 16_137_912_320 + 6 * 48 * 40 * 128 * 101


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


def test_qwen3_30b_a3b_counts_its_active_parameters_by_hand():
    """Qwen3-30B-A3B as its report gives it: 30.5B parameters, 3.3B activated per token (48 layers,
    128 experts of width 768, 8 per token). Per layer: attention q,o 2*2048*32*128 = 16,777,216
    and k,v 2*2048*4*128 = 2,097,152; router 2048*128 = 262,144; 8 experts 3*2048*768*8 =
    37,748,736; sum 56,885,248; x 48 = 2,730,491,904; head 2048*151936 = 311,164,928."""
    config = get_preset("qwen3-30b-a3b")
    assert matmul_params(config) == 2_730_491_904 + 311_164_928
    idle_experts = 48 * (128 - 8) * 3 * 2048 * 768
    assert round(config.num_params() / 1e9, 1) == 30.5
    assert 3.3e9 <= config.num_params() - idle_experts < 3.4e9  # the report's "3.3B activated" (3.35B)
