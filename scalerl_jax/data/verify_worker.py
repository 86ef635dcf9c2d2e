"""Worker process for ``verify_pool.VerifyPool``: math-verify on its own main thread.

Run as a script (``python -P verify_worker.py SOFT_TIMEOUT_S``), not as a package module, so it
imports only math-verify and the standard library. Protocol: JSON lines. The worker first writes
``{"status": "ready"}``; then for each request line ``{"gold": str, "pred": str}`` it writes one
response ``{"status": S, "detail": str}`` with ``S`` one of ``equal``, ``not_equal``,
``unparsable`` (either side parsed to nothing), ``timeout`` (math-verify's own signal timeout of
SOFT_TIMEOUT_S seconds per call fired), ``error`` (any other exception). Both sides are parsed
from ``\\boxed{...}`` so the box's content is read as LaTeX, then ``verify(gold, pred)``.
It exits at end of input. Library output on stdout is moved to stderr so it cannot corrupt the
protocol stream.
"""

import functools
import json
import os
import sys


def main() -> None:
    """Serves requests from stdin until end of input."""
    soft_timeout_s = int(sys.argv[1])
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    import logging
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    @functools.lru_cache(maxsize=4096)
    def parse_boxed(text: str):
        return parse("\\boxed{" + text + "}", parsing_timeout=soft_timeout_s, raise_on_error=True)

    def respond(status: str, detail: str = "") -> None:
        protocol.write(json.dumps({"status": status, "detail": detail}) + "\n")

    respond("ready")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            gold = parse_boxed(request["gold"])
            pred = parse_boxed(request["pred"])
            if not gold or not pred:
                respond("unparsable", "gold" if not gold else "pred")
                continue
            equal = verify(gold, pred, timeout_seconds=soft_timeout_s, raise_on_error=True)
            respond("equal" if equal else "not_equal")
        except TimeoutException as e:
            respond("timeout", str(e)[:200])
        except Exception as e:  # any failure of the verifier on this item is reported, not fatal
            respond("error", f"{type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
