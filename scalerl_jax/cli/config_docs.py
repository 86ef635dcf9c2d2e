"""`python -m scalerl_jax.cli.config_docs [--out docs/config.md]` (`scalerl config-docs`): the
reference of every config key, generated from the schema (`scalerl_jax.config.schema.markdown`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from scalerl_jax.config.schema import markdown


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the reference, or writes it to --out."""
    parser = argparse.ArgumentParser(
        prog="python -m scalerl_jax.cli.config_docs", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--out", help="write to this file instead of standard output")
    args = parser.parse_args(argv)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(markdown())
    else:
        sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
