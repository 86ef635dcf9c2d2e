"""Export a run's policy as a Hugging Face checkpoint directory:
``python -m scalerl_jax.cli.export RUN_DIR [--step N] --out DIR [--overwrite]``.

The params come from the run's orbax checkpoint at ``--step`` (default: the latest); the
architecture and the tokenizer from the run's base checkpoint (its warm start, or
``config.model.checkpoint``). ``DIR`` receives ``config.json`` and ``model.safetensors`` (sharded
with ``model.safetensors.index.json`` above 5 GiB) in the run's ``model.dtype``, the base's
tokenizer files (``TOKENIZER_FILES`` that exist there) and ``generation_config.json`` (the base's,
or one with the model's bos/eos ids), loadable by ``transformers.AutoModelForCausalLM`` and
``AutoTokenizer``. The directory is written under ``DIR.tmp`` and renamed when complete.

Exit status: 0 on success, 2 on bad input (one line naming the directory, step or file), 1 when
the output cannot be written (one line naming the path; `SCALERL_DEBUG=1` prints the traceback too).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from scalerl_jax.cli.errors import EXIT_INPUT_ERROR, EXIT_RUN_ERROR, report_error
from scalerl_jax.models.hf_tokenizer import CheckpointFileError
from scalerl_jax.run import policy_source
from scalerl_jax.run.export import ExportError, export_run


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="python -m scalerl_jax.cli.export", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("run_dir", help="run directory (with config.json and checkpoints/)")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--out", required=True, help="output Hugging Face directory")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (module docstring), the reason on stderr."""
    args = build_parser().parse_args(argv)
    try:
        out = export_run(args.run_dir, args.out, step=args.step, overwrite=args.overwrite)
    except (policy_source.PolicySourceError, ExportError, CheckpointFileError, FileNotFoundError) as e:
        return report_error(f"error: {e}", EXIT_INPUT_ERROR)
    except OSError as e:  # the output cannot be written (read-only or full disk, no permission)
        where = f" ({e.filename})" if e.filename else ""
        return report_error(f"error: cannot write the export to {args.out}: {e.strerror or e}{where}", EXIT_RUN_ERROR)
    print(f"exported {args.run_dir} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
