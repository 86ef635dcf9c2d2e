"""`python -m scalerl_jax.cli.plan_memory` (`scalerl plan-memory`): will the 8B recipe fit? The
train step's memory per device (params, optimizer, gradients, activations) on a mesh, and how many
decode slots the sampler's KV cache allows on one device, with the recipe's defaults
(`scalerl_jax.models.memory` has the arithmetic)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from scalerl_jax.cli.errors import EXIT_INPUT_ERROR, report_error
from scalerl_jax.config import recipes
from scalerl_jax.hardware.facts import TARGETS
from scalerl_jax.models.config import get_preset
from scalerl_jax.models.memory import (
    DEFAULT_DECODE_TARGET,
    DEFAULT_FIT_TARGETS,
    PLATFORMS,
    facts_for_target,
    format_decode_plan,
    format_plan,
    memory_gb,
    plan_decode,
    plan_memory,
    resolve_attention_impl,
)


def recipe_decode_defaults() -> dict[str, float]:
    """max_len, page size, mean prompt and mean completion of the recipe (configs/scalerl_8b.py):
    max_len = max_prompt_tokens + max_new_tokens; page_size = sampler.page_size; prompt =
    max_prompt_tokens (an upper bound: prompts are at most that long); completion = the think
    budget's midpoint (think_budget_min + max) / 2."""
    config = recipes.scalerl_8b()
    return {
        "max_len": config.data.max_prompt_tokens + config.sampler.max_new_tokens,
        "page_size": config.sampler.page_size,
        "mean_prompt": config.data.max_prompt_tokens,
        "mean_completion": (config.sampler.think_budget_min + config.sampler.think_budget_max) / 2,
    }


def parse_mesh(text: str) -> list[int]:
    """`--mesh` 'data,fsdp,tensor' as three positive sizes; ValueError naming the flag otherwise."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--mesh {text!r}: expected three positive sizes data,fsdp,tensor (e.g. 1,8,1)")
    return [int(p) for p in parts]


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the plans; 0, or 2 with one line naming a bad flag (an unknown preset, a mesh that
    does not divide the model's axes)."""
    try:
        _plan(argv)
    except ValueError as e:
        return report_error(f"error: {e}", EXIT_INPUT_ERROR)
    return 0


def _plan(argv: Sequence[str] | None) -> None:
    defaults = recipe_decode_defaults()
    parser = argparse.ArgumentParser(
        prog="python -m scalerl_jax.cli.plan_memory", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--report", default="all", choices=("all", "train", "decode"))
    parser.add_argument("--preset", default="llama3.1-8b")
    parser.add_argument("--mesh", default="1,8,1", help="data,fsdp,tensor sizes")
    parser.add_argument("--microbatch", type=int, default=8, help="sequences per microbatch (global)")
    parser.add_argument("--seq_len", type=int, default=16_384)
    parser.add_argument("--remat", default="full", help="remat policy name")
    parser.add_argument("--dtype", default=None, help="override the preset's body dtype")
    parser.add_argument("--attention_impl", default="auto", help="auto | xla | cudnn")
    parser.add_argument(
        "--device",
        default=None,
        choices=tuple(TARGETS),
        help=f"the device to plan for (default: train fit on {' and '.join(DEFAULT_FIT_TARGETS)}, decode on "
        f"{DEFAULT_DECODE_TARGET}); sets --platform and --device_gb unless they are given",
    )
    parser.add_argument(
        "--platform",
        default=None,
        choices=PLATFORMS,
        help="device platform 'auto' attention resolves for (default: the device's, else gpu)",
    )
    parser.add_argument("--logprob_chunk", type=int, default=512)
    parser.add_argument("--kv_slots", type=int, default=0, help="sampler slots for a KV cache line")
    parser.add_argument("--usable_fraction", type=float, default=0.9)
    parser.add_argument(
        "--max_len", type=int, default=int(defaults["max_len"]), help="decode: tokens per slot (prompt + completion)"
    )
    parser.add_argument(
        "--page_size",
        type=int,
        default=int(defaults["page_size"]),
        help="decode: tokens per KV page (default: the recipe's sampler.page_size)",
    )
    parser.add_argument(
        "--mean_prompt",
        type=float,
        default=defaults["mean_prompt"],
        help="decode: mean prompt tokens (default: the recipe's max_prompt_tokens)",
    )
    parser.add_argument(
        "--mean_completion",
        type=float,
        default=defaults["mean_completion"],
        help="decode: mean completion tokens (default: the recipe's think budget midpoint)",
    )
    parser.add_argument(
        "--device_gb", type=float, default=None, help="decode: device memory (GB; default: the device's)"
    )
    parser.add_argument(
        "--workspace_gb", type=float, default=4.0, help="decode: scratch kept free for the decode step and prefill"
    )
    args = parser.parse_args(argv)
    device = facts_for_target(args.device or DEFAULT_DECODE_TARGET)
    args.platform = args.platform or (device.platform if args.device else "gpu")
    device_label = f" ({device.name})" if args.device_gb is None else ""
    args.device_gb = args.device_gb or memory_gb(device)
    fit_devices = [device] if args.device else [facts_for_target(t) for t in DEFAULT_FIT_TARGETS]
    overrides = {k: v for k, v in (("dtype", args.dtype), ("attention_impl", args.attention_impl)) if v}
    mesh = parse_mesh(args.mesh)
    config = get_preset(args.preset, **overrides)
    if args.report in ("all", "decode"):
        plan = plan_decode(
            config,
            max_len=args.max_len,
            page_size=args.page_size,
            mean_prompt=args.mean_prompt,
            mean_completion=args.mean_completion,
            device_gb=args.device_gb,
            usable_fraction=args.usable_fraction,
            workspace_gb=args.workspace_gb,
        )
        print(
            format_decode_plan(
                plan,
                f"decode: {args.preset} ({config.dtype}, fp32_head={config.fp32_head}) on "
                f"one {args.device_gb:g} GB device{device_label}, max_len {args.max_len}",
            )
        )
    if args.report == "decode":
        return
    plan = plan_memory(
        config,
        mesh,
        microbatch=args.microbatch,
        seq_len=args.seq_len,
        remat_policy=args.remat,
        logprob_chunk=args.logprob_chunk,
        kv_slots=args.kv_slots,
        platform=args.platform,
    )
    title = (
        f"{args.preset} ({config.num_params():,} params, {config.dtype}, fp32_head={config.fp32_head}) on mesh "
        f"data,fsdp,tensor={args.mesh}; microbatch {args.microbatch} x {args.seq_len} tokens, remat "
        f"{args.remat}, attention {config.attention_impl} -> "
        f"{resolve_attention_impl(config, args.platform)} on {args.platform}"
    )
    print(format_plan(plan, title, args.usable_fraction, fit_devices))


if __name__ == "__main__":
    sys.exit(main())
