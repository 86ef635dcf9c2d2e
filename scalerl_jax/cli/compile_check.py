"""Compile every program of a run for accelerators that are not attached, and say whether each fits.

    python -m scalerl_jax.cli.compile_check --config=configs/scalerl_8b.py --target=h200:1x8
    python -m scalerl_jax.cli.compile_check --config=configs/scalerl_8b.py --target=h100:10x8
    python -m scalerl_jax.cli.compile_check --config=configs/scalerl_8b.py --target=v5p:4x4x4 --config.KEY=VALUE

TARGET names a deviceless topology: GPU nodes as `h100:HOSTSxGPUS` or `h200:HOSTSxGPUS` (8 GPUs per
host on HGX boards), TPU slices as `v5e:AxB`, `v6e:AxB`, `v5p:AxBxC` (chips along each axis of the
slice; 4 chips per host). JAX describes those devices without them (`jax.experimental.topologies`:
libtpu for TPU, the CUDA plugin with a GPU target description from `scalerl_jax.hardware` for GPU);
the run's meshes are built on them as `main` builds them, and every program of the run is lowered
and compiled (`run.programs`), one at a time, with progress.

Per program the table gives XLA's per-device argument, temporary and peak bytes, the long-lived
bytes its devices hold besides its arguments (`run.programs.RunProgram.resident_bytes`), their sum
against the device's memory, and whether it fits. On TPU a program that cannot fit is a compile
error (RESOURCE_EXHAUSTED), reported as not fitting; on GPU nothing stops a compile, so the sum is
the check. Exit status: 0 when every program compiles and fits, 1 when one does not (its name and
the config keys that size it are printed), 2 on bad input or a missing extra (`tpu` or `cuda`).
Compile times say nothing about speed: without a device, nothing is autotuned.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from scalerl_jax.cli.errors import EXIT_INPUT_ERROR, EXIT_RUN_ERROR, report_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scalerl_jax.cli.compile_check",
        description="Compile every program of a run for a deviceless GPU or TPU topology; say what fits.",
        epilog="--config=FILE and --config.KEY=VALUE overrides are read as main reads them.",
    )
    parser.add_argument("--target", required=True, help="h100:HOSTSxGPUS, h200:HOSTSxGPUS, v5e:AxB, v6e:AxB, v5p:AxBxC")
    parser.add_argument(
        "--programs",
        help="only programs whose 'name shape' matches this regular expression (e.g. 'accumulate.*T=16384$')",
    )
    parser.add_argument("--out", help="write the table as JSON here")
    return parser


def load_config(extra: Sequence[str]) -> Any:
    """The config of `--config=FILE [--config.KEY=VALUE ...]`, checked as main checks it (files aside)."""
    from scalerl_jax.config.argv import CONFIG_ARGV_ERRORS, config_argv_problem, parse_config_argv
    from scalerl_jax.config.validation import validate
    from scalerl_jax.run.compile_report import CompileCheckError

    unknown = [a for a in extra if not a.startswith("--config")]
    if unknown:
        raise CompileCheckError(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        config = parse_config_argv(["compile_check", *extra])
    except CONFIG_ARGV_ERRORS as e:
        raise CompileCheckError(config_argv_problem(["compile_check", *extra], e)) from e
    if config is None:
        raise CompileCheckError("--config=FILE is required (e.g. --config=configs/scalerl_8b.py)")
    validate(config, check_files=False)
    return config


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (module docstring)."""
    # Deviceless compilation needs no attached device; the CUDA plugin would otherwise try to start one.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # libtpu probes the host for a TPU it would not use here (the topology is given explicitly) and
    # logs a page of warnings without these; and it needs no exclusive lock to only compile.
    for name, value in (("TPU_ACCELERATOR_TYPE", "v5litepod-4"), ("TPU_WORKER_HOSTNAMES", "localhost")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # XLA's own warnings about programs too large would bury the progress lines; the table says it.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from scalerl_jax.config.devices import check_devices
    from scalerl_jax.config.errors import ConfigError
    from scalerl_jax.models.hf_tokenizer import CheckpointFileError
    from scalerl_jax.run.compile_report import (  # after the environment above: it starts JAX
        GIB,
        CompileCheckError,
        compile_rows,
        format_table,
        parse_target,
        require_extra,
        target_devices,
    )

    args, extra = build_parser().parse_known_args(argv)
    try:
        pattern = re.compile(args.programs) if args.programs else None
        kind, dims = parse_target(args.target)
        require_extra(kind)
        config = load_config(extra)
        devices = target_devices(kind, dims)
        check_devices(config, len(devices))
        from scalerl_jax.hardware.facts import facts_for_target

        facts = facts_for_target(kind)
        processes = len({d.process_index for d in devices})
        print(
            f"target {args.target}: {len(devices)} x {devices[0].device_kind} ({facts.memory_bytes / GIB:.1f} GiB each) "
            f"over {processes} host process(es)",
            flush=True,
        )
        rows = compile_rows(config, devices, facts.memory_bytes, pattern)
    except (CompileCheckError, ConfigError, CheckpointFileError, re.error, FileNotFoundError) as e:
        return report_error(f"error: {e}", EXIT_INPUT_ERROR)
    except ValueError as e:  # a run part refusing the config's sizes, e.g. slots that do not split over devices
        return report_error(f"error: the run cannot be built from this config on {args.target}: {e}", EXIT_INPUT_ERROR)
    print(format_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"target": args.target, "rows": [dataclasses.asdict(r) | {"total_bytes": r.total_bytes} for r in rows]},
                f,
                indent=1,
            )
    failing = [r for r in rows if not r.fits]
    if not failing:
        print(f"every program fits ({len(rows)} compiled)")
        return 0
    from scalerl_jax.config.schema import sized_by

    worst = max(failing, key=lambda r: (bool(r.error), r.total_bytes))
    print(
        f"{len(failing)} program(s) do not fit, e.g. {worst.role} {worst.name} {worst.shape} "
        f"({'compiler: ' + worst.error if worst.error else f'{worst.total_bytes / GIB:.2f} GiB'} on a "
        f"{worst.device_bytes / GIB:.2f} GiB device); config keys that size it: {', '.join(sized_by(worst.name))}",
        file=sys.stderr,
    )
    return EXIT_RUN_ERROR


if __name__ == "__main__":
    sys.exit(main())
