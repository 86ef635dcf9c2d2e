"""Accuracy of the FP32 head's algorithms on an 8B-shaped head, against float64 (CPU, numpy emulation).

    PYTHONPATH=. python benchmarks/head_precision_accuracy.py [--hidden 4096 --vocab 16384 --rows 64]

The GPU algorithm `DotAlgorithmPreset.BF16_BF16_F32_X3` ('bf16x3') cannot run here, so it is
emulated with the same arithmetic: x = x_hi + x_lo with x_hi = bf16(x), x_lo = bf16(x - x_hi);
x.y ~ x_hi.y_lo + x_lo.y_hi + x_hi.y_hi, bf16 products accumulated in float32 (float32 sgemm on
bf16-valued operands, whose products are exact in float32). Rows: the error of the selected-token
log-prob |log p - log p_64| and of the CISPO/PPO ratio exp(log p - log p_64) - 1 that such an error
would put between sampler and trainer. 'jax highest' / 'jax bf16x3 (this backend)' run the real
`fp32_logits` on the local backend (on CPU both are exact float32). What is unmeasured: speed on GPU,
and XLA GPU's actual accumulation order for the algorithm.
"""

from __future__ import annotations

import argparse

import jax
import ml_dtypes
import numpy as np

from scalerl_jax.models.transformer import fp32_logits


def to_bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (nearest even), as float32."""
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def bf16x3_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a_hi b_hi + a_hi b_lo + a_lo b_hi with hi/lo bf16 parts, float32 accumulation."""
    a_hi, b_hi = to_bf16(a), to_bf16(b)
    a_lo, b_lo = to_bf16(a - a_hi), to_bf16(b - b_hi)
    return a_hi @ b_lo + a_lo @ b_hi + a_hi @ b_hi


def picked_logprobs(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log softmax(logits)[target] in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return np.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=16_384, help="a slice of the 128k vocabulary")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--logit_std", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    hidden = rng.normal(size=(args.rows, args.hidden)).astype(np.float32)  # final-normed: rms ~ 1
    weight = (rng.normal(size=(args.hidden, args.vocab)) * args.logit_std / np.sqrt(args.hidden)).astype(np.float32)
    exact = hidden.astype(np.float64) @ weight.astype(np.float64)
    jax_logits = lambda name: np.asarray(jax.jit(lambda h, w: fp32_logits(h, w, name))(hidden, weight))  # noqa: E731
    targets = np.argsort(-exact, axis=-1)[:, rng.integers(0, 50)]  # a plausible (high-probability) token
    reference = picked_logprobs(exact, targets)
    candidates = {
        "bf16 operands, fp32 accumulate": to_bf16(hidden) @ to_bf16(weight),
        "bf16x3 (numpy emulation)": bf16x3_matmul(hidden, weight),
        "fp32 (numpy sgemm)": hidden @ weight,
        "jax highest": jax_logits("highest"),
        f"jax bf16x3 ({jax.default_backend()})": jax_logits("bf16x3"),
    }
    print(
        f"head [{args.rows}, {args.hidden}] @ [{args.hidden}, {args.vocab}], logit std {args.logit_std}; "
        "errors against float64"
    )
    print(f"  {'algorithm':<34}{'max |dlogp|':>14}{'max |ratio-1|':>16}{'vs fp32':>10}")
    fp32_error = np.abs(picked_logprobs(candidates["fp32 (numpy sgemm)"], targets) - reference).max()
    for name, logits in candidates.items():
        error = np.abs(picked_logprobs(logits, targets) - reference).max()
        print(f"  {name:<34}{error:14.3e}{np.expm1(error):16.3e}{error / fp32_error:10.1f}x")


if __name__ == "__main__":
    main()
