"""Memory plan: exact per-device parameter / optimizer / gradient bytes against a hand calculation."""

import pytest

from scalerl_jax.cli.plan_memory import main
from scalerl_jax.models import get_preset
from scalerl_jax.models.memory import activation_terms, kv_bytes_per_token, kv_cache_bytes, plan_decode, plan_memory


def test_llama31_8b_fsdp8_bytes_by_hand():
    # Mesh data=1, fsdp=8, tensor=1; bf16 body, fp32 head. Per device (norms are replicated):
    #   embed [128256, 4096] bf16 / 8 on embed:        128256 * 512 * 2      =   131,334,144
    #   lm_head [4096, 128256] fp32 / 8:                512 * 128256 * 4     =   262,668,288
    #   q, o [32, 4096, 32*128] bf16 / 8:               2 * 32*512*4096*2    =   268,435,456
    #   k, v [32, 4096, 8*128] bf16 / 8:                2 * 32*512*1024*2    =    67,108,864
    #   gate, up, down [32, 4096, 14336] bf16 / 8:      3 * 32*512*14336*2   = 1,409,286,144
    #   2 norms [32, 4096] bf16 replicated:             2 * 32*4096*2        =       524,288
    #   final norm [4096] bf16:                                                         8,192
    #   total                                                                 = 2,139,365,376
    # The same in fp32 (Adam moments, the optimizer's master copy of a bf16 body, gradient
    # accumulator): 4,016,062,464.
    plan = plan_memory(get_preset("llama3.1-8b"), (1, 8, 1), microbatch=8, seq_len=4096, remat_policy="full")
    assert plan.params == 2_139_365_376
    assert plan.optimizer == 3 * 4_016_062_464  # mu, nu and the fp32 master
    assert plan.gradients == 4_016_062_464 + 2_139_365_376
    assert plan.total == plan.params + plan.optimizer + plan.gradients + plan.activations


def test_tensor_parallel_and_kv_cache_bytes():
    # tensor=2 also splits heads/mlp/vocab: the MLP of llama3.1-8b becomes 3 * 32*512*7168*2 bytes.
    config = get_preset("llama3.1-8b")
    fsdp_only = plan_memory(config, (1, 8, 1), microbatch=8, seq_len=1024, remat_policy="full")
    with_tp = plan_memory(config, (1, 4, 2), microbatch=8, seq_len=1024, remat_policy="full")
    assert with_tp.params == fsdp_only.params  # 8 shards either way, norms replicated
    # KV cache: 2 (k, v) * 32 layers * 64 slots * 16384 * 8 kv heads * 128 * 2 bytes, slots over fsdp=8.
    assert (
        kv_cache_bytes(config, {"data": 1, "fsdp": 8, "tensor": 1}, slots=64, max_len=16384)
        == 2 * 32 * 64 * 16384 * 8 * 128 * 2 // 8
    )


def test_remat_policies_order_activation_estimates():
    config = get_preset("llama3.1-8b")
    act = {
        policy: plan_memory(config, (1, 8, 1), microbatch=8, seq_len=8192, remat_policy=policy).activations
        for policy in ("none", "dots", "dots_with_no_batch_dims", "full")
    }
    assert act["none"] > act["dots"] > act["dots_with_no_batch_dims"] > act["full"] > 0


def test_moe_layer_activations_by_hand():
    """tiny-qwen3-moe (d 64, 4 / 2 heads of 16, 8 experts of width 64, 2 per token, 2 layers,
    float32), 2 sequences of 32 tokens on one device, remat 'none', XLA attention: per token and
    layer e (4 d + 3 H hd + 4 K hd + 3 F rows) + scores H T (4 + e) + router 8 E + rows d (e + 4),
    rows = 2 (ragged, GPU) or 8 (dense, CPU): 4 (256 + 192 + 128 + 384) + 1024 + 64 + 1024 = 5952
    and 4 (256 + 192 + 128 + 1536) + 1024 + 64 + 4096 = 13632; x 2 layers x 64 tokens."""
    config = get_preset("tiny-qwen3-moe")
    terms = {
        platform: activation_terms(
            config, {}, microbatch=2, seq_len=32, remat_policy="none", logprob_chunk=32, platform=platform
        )["saved_by_remat_policy"]
        for platform in ("gpu", "cpu")
    }
    assert terms == {"gpu": 5952 * 2 * 64, "cpu": 13632 * 2 * 64}


def test_indivisible_mesh_is_named():
    with pytest.raises(ValueError, match="kv_heads.*not divisible"):
        plan_memory(get_preset("qwen2.5-7b"), (1, 1, 8), microbatch=8, seq_len=1024)  # 4 KV heads on tensor=8


def test_cli_prints_fit(capsys):
    main(
        [
            "--preset",
            "llama3.1-8b",
            "--mesh",
            "1,8,1",
            "--microbatch",
            "8",
            "--seq_len",
            "16384",
            "--remat",
            "full",
            "--attention_impl",
            "cudnn",
        ]
    )
    out = capsys.readouterr().out
    assert "H100 SXM 80GB: fits" in out and "H200 SXM 141GB: fits" in out and "optimizer" in out


def test_decode_plan_llama31_8b_h200_by_hand():
    # KV bytes per token = 2 (k, v) * 32 layers * 8 kv heads * 128 head_dim * 2 (bf16) = 131,072.
    # Generator weights on one device (bf16 body, fp32 head): the fsdp=8 shards above times 8 with the
    # replicated norms counted once: 8 * (2,139,365,376 - 532,480) + 532,480 = 17,111,195,648.
    # Budget = 141e9 - 0.1 * 141e9 - 4e9 workspace - weights = 105,788,804,352.
    # (a) 16,384 tokens per slot = 2,147,483,648 B -> floor(49.26) = 49 slots.
    # (b) live tokens per slot = 2,048 + 11,264 / 2 = 7,680 -> 480 pages of 16 = 1,006,632,960 B
    #     -> floor(105.09) = 105 slots, pool 105 * 480 = 50,400 pages; synchronized: 13,312 tokens
    #     = 832 pages = 1,744,830,464 B -> floor(60.63) = 60 slots.
    config = get_preset("llama3.1-8b")
    assert kv_bytes_per_token(config) == 131_072
    plan = plan_decode(
        config,
        max_len=16_384,
        page_size=16,
        mean_prompt=2_048,
        mean_completion=11_264,
        device_gb=141,
        usable_fraction=0.9,
        workspace_gb=4.0,
    )
    assert plan.weights == 17_111_195_648
    assert plan.kv_budget == 105_788_804_352
    assert plan.slots_unpaged == 49
    assert plan.pages_per_slot == 480 and plan.slots_paged == 105 and plan.num_pages == 50_400
    assert plan.pages_per_slot_synchronized == 832 and plan.slots_paged_synchronized == 60


def test_decode_plan_rounds_live_tokens_up_to_pages():
    # tiny-llama (float32): KV per token = 2 * 2 layers * 2 kv heads * 16 * 4 = 512 B. 10 + 7 / 2 = 13.5
    # live tokens -> ceil(13.5 / 4) = 4 pages of 4 tokens per slot.
    config = get_preset("tiny-llama")
    assert kv_bytes_per_token(config) == 512
    plan = plan_decode(config, max_len=64, page_size=4, mean_prompt=10, mean_completion=7, device_gb=1)
    assert plan.pages_per_slot == 4
    assert plan.slots_paged == plan.kv_budget // (4 * 4 * 512)


def test_cli_decode_report(capsys):
    main(["--report", "decode", "--preset", "llama3.1-8b", "--max_len", "16384", "--page_size", "16"])
    out = capsys.readouterr().out
    assert "-> 49 slots" in out and "-> 105 slots" in out and "num_pages=50400" in out
    assert "mean completion 11,264" in out  # the recipe's think budget midpoint, stated
    assert "H100 SXM 80GB" not in out  # the training plan is not printed


def test_tpu_plan_keeps_the_attention_score_matrix_only_for_xla_attention():
    # On TPU attention_impl='auto' is the Pallas splash kernel (flash-like, layers.resolve_attention_impl);
    # 'xla' keeps the scores: one layer's working set per token holds H/tp * T * (4 + e) bytes of scores
    # and probabilities instead of flash's H/tp * (4 + hd e): b = 8 / 8 = 1 sequence of T = 4,096 tokens
    # per device, H = 32, hd = 128, e = 2 (bf16): 4,096 * 32 * (4,096 * 6 - (4 + 256)) = 3,187,146,752 bytes more.
    plans = {
        impl: plan_memory(
            get_preset("llama3.1-8b", attention_impl=impl),
            (1, 8, 1),
            microbatch=8,
            seq_len=4096,
            remat_policy="full",
            platform="tpu",
        )
        for impl in ("auto", "xla")
    }
    difference = {
        term: plans["xla"].activation_terms[term] - plans["auto"].activation_terms[term]
        for term in plans["auto"].activation_terms
    }
    assert difference == {
        "layer_inputs": 0,
        "saved_by_remat_policy": 0,
        "one_layer_working_set": 3_187_146_752,
        "head_hidden_fp32": 0,
        "logprob_chunk": 0,
    }
    config = get_preset("llama3.1-8b")
    with pytest.raises(ValueError, match="unknown platform 'tpuv5'"):
        plan_memory(config, (1, 8, 1), microbatch=8, seq_len=4096, platform="tpuv5")


def test_cli_plans_for_a_tpu_device(capsys):
    # --device v5e: a TPU v5e chip has 16 GB (Cloud TPU v5e page); the 8B model's fsdp=8 shards alone are
    # params 2.14 GB + Adam and master 12.05 GB + gradients 6.16 GB = 20.3 GB > 0.9 * 16 GB, so it does not
    # fit; 'auto' attention resolves to the splash kernel on TPU.
    main(["--report", "train", "--preset", "llama3.1-8b", "--mesh", "1,8,1", "--seq_len", "4096", "--device", "v5e"])
    out = capsys.readouterr().out
    assert "TPU v5e: does NOT fit" in out and "x 16 GB" in out
    assert "-> splash on tpu" in out
    assert "H100" not in out and "H200" not in out


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--preset", "llama4-scout", "--mesh", "1,32,1"], "'expert', size 16"),  # 16 experts over fsdp=32
        (["--preset", "llama9"], "llama9"),
        (["--mesh", "1,8"], "--mesh"),
        (["--mesh", "1,x,1"], "--mesh"),
    ],
    ids=["experts over too many devices", "unknown preset", "two mesh axes", "not a number"],
)
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, named):
    assert main(["--report", "train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err
