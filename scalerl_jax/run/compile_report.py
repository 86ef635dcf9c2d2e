"""Every program of a run compiled for accelerators that are not attached, and whether each fits
(`scalerl_jax.cli.compile_check` is its command line).

TARGET names a deviceless topology: GPU nodes as `h100:HOSTSxGPUS` or `h200:HOSTSxGPUS` (8 GPUs per
host on HGX boards), TPU slices as `v5e:AxB`, `v6e:AxB`, `v5p:AxBxC` (chips along each axis of the
slice; 4 chips per host). JAX describes those devices without them (`jax.experimental.topologies`:
libtpu for TPU, the CUDA plugin with a GPU target description from `scalerl_jax.hardware` for GPU);
the run's meshes are built on them as the run builds them, and every program of the run is lowered
and compiled (`run.programs`), one at a time, with progress.

Per program a `Row` gives XLA's per-device argument, temporary and peak bytes, the long-lived
bytes its devices hold besides its arguments (`run.programs.RunProgram.resident_bytes`), their sum
against the device's memory, and whether it fits. On TPU a program that cannot fit is a compile
error (RESOURCE_EXHAUSTED), reported as not fitting; on GPU nothing stops a compile, so the sum is
the check. Compile times say nothing about speed: without a device, nothing is autotuned.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import time
from collections.abc import Sequence
from typing import Any

GIB = 1024**3


GPU_TARGET = re.compile(r"^(h100|h200):(\d+)x(\d+)$")


TPU_TARGET = re.compile(r"^(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})$")


class CompileCheckError(ValueError):
    """Bad input to the compile check: a target, a config, a missing extra."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One program's line of the table."""

    role: str
    name: str
    shape: str
    devices: int
    compile_s: float
    argument_bytes: int
    temp_bytes: int
    peak_bytes: int
    resident_bytes: int
    device_bytes: int
    error: str = ""  # the compiler's out-of-memory message, when it refused

    @property
    def total_bytes(self) -> int:
        """What one device holds at the program's peak: its XLA peak plus the resident bytes."""
        return self.peak_bytes + self.resident_bytes

    @property
    def fits(self) -> bool:
        return not self.error and self.total_bytes <= self.device_bytes


def peak_bytes(memory: Any) -> int:
    """XLA's per-device peak of a compiled program; where the backend reports none (0), the sum
    arguments + outputs - aliased + temporaries (every buffer live at once: an upper bound)."""
    peak = int(getattr(memory, "peak_memory_in_bytes", 0) or 0)
    if peak:
        return peak
    return int(
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )


def parse_target(text: str) -> tuple[str, tuple[int, ...]]:
    """'h200:1x8' -> ('h200', (1, 8)) (hosts, GPUs per host); 'v5p:4x4x4' -> ('v5p', (4, 4, 4))
    (chips per slice axis). CompileCheckError on anything else."""
    match = GPU_TARGET.match(text) or TPU_TARGET.match(text)
    if match is None:
        raise CompileCheckError(
            f"--target={text!r}: expected h100:HOSTSxGPUS or h200:HOSTSxGPUS (e.g. h200:1x8, h100:10x8), "
            "or a TPU slice v5e:AxB, v6e:AxB, v4:AxBxC, v5p:AxBxC (e.g. v5e:2x2, v5p:4x4x4)"
        )
    kind = match.group(1)
    dims = (
        tuple(int(d) for d in match.groups()[1:])
        if kind in ("h100", "h200")
        else tuple(int(d) for d in match.group(2).split("x"))
    )
    if min(dims) < 1:
        raise CompileCheckError(f"--target={text!r}: every size must be >= 1")
    if kind in ("v4", "v5p") and len(dims) != 3:
        raise CompileCheckError(f"--target={text!r}: a {kind} slice has three axes (e.g. {kind}:2x2x2)")
    if kind in ("v5e", "v6e") and len(dims) != 2:
        raise CompileCheckError(f"--target={text!r}: a {kind} slice has two axes (e.g. {kind}:2x4)")
    return kind, dims


def require_extra(kind: str) -> None:
    """CompileCheckError naming the extra to install when the target's compiler is missing."""
    if kind in ("h100", "h200"):
        if importlib.util.find_spec("jax_cuda12_plugin") is None:
            raise CompileCheckError(
                f"--target {kind}: compiling for GPUs needs JAX's CUDA plugin: pip install -e '.[cuda]' (no GPU needed)"
            )
    elif importlib.util.find_spec("libtpu") is None:
        raise CompileCheckError(
            f"--target {kind}: compiling for TPUs needs libtpu: pip install -e '.[tpu]' (no TPU needed)"
        )


def target_devices(kind: str, dims: tuple[int, ...]) -> list[Any]:
    """The devices of the deviceless topology (all hosts'), ordered by process then id."""
    from jax.experimental import topologies

    from scalerl_jax.hardware.facts import facts_for_target, gpu_target_config_text

    facts = facts_for_target(kind)
    if kind in ("h100", "h200"):
        hosts, per_host = dims
        topology = topologies.get_topology_desc(
            platform="cuda", topology=f"1x{hosts}x{per_host}", target_config=gpu_target_config_text(facts)
        )
    else:
        axes = dims + (1,) * (3 - len(dims))
        bounds = tuple(min(b, a) for b, a in zip(facts.chips_per_host_bounds or (2, 2, 1), axes))
        topology = topologies.get_topology_desc(
            topology_name=f"{facts.topology_prefix}:{'x'.join(map(str, dims))}",
            platform="tpu",
            chip_config_name=facts.chip_config_name,
            chips_per_host_bounds=bounds,
            num_slices=1,
            wrap=(False, False, False),
        )
    return sorted(topology.devices, key=lambda d: (d.process_index, d.id))


def token_counts(config: Any) -> tuple[int, tuple[int, int], str]:
    """(stop ids, (interruption phrase, think-end tag) in tokens, where they come from): from the
    checkpoint's tokenizer when `model.checkpoint` names one; otherwise 4 stop ids (the engine's
    default room) and the texts' UTF-8 byte counts, an upper bound on any byte-level BPE's count
    (they only size small constant arrays of the decode program)."""
    from scalerl_jax.models import load_checkpoint_tokenizer

    phrase, end_think = config.sampler.interruption_phrase, config.sampler.think_end
    if config.model.checkpoint and "warm_start" not in config:
        tokens = load_checkpoint_tokenizer(config.model.checkpoint)

        def count(text: str) -> int:
            return len(tokens.tokenizer.encode(text, add_special_tokens=False).ids)

        return len(tokens.stop_ids), (count(phrase), count(end_think)), f"tokenizer of {config.model.checkpoint}"
    lengths = (len(phrase.encode()), len(end_think.encode()))
    return 4, lengths, "no checkpoint tokenizer: 4 stop ids, phrase and think-end tag counted in UTF-8 bytes"


def gib(n: float) -> str:
    return f"{n / GIB:8.2f}"


def format_table(rows: Sequence[Row]) -> str:
    """The per-program table (GiB per device; 'compile s': tracing and XLA's compile of the program)."""
    header = (
        f"{'role':<14} {'program':<26} {'shape':<34} {'devs':>5} {'compile s':>9} "
        f"{'args':>8} {'temp':>8} {'peak':>8} {'resident':>8} {'total':>8} {'device':>8}  fits"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.role:<14} {r.name:<26} {r.shape[:34]:<34} {r.devices:>5} {r.compile_s:>9.1f} "
            f"{gib(r.argument_bytes)} {gib(r.temp_bytes)} {gib(r.peak_bytes)} {gib(r.resident_bytes)} "
            f"{gib(r.total_bytes)} {gib(r.device_bytes)}  {'yes' if r.fits else 'NO'}"
        )
    return "\n".join(lines)


def out_of_memory(error: BaseException) -> bool:
    """Whether a compile error is the compiler refusing a program that exceeds the device's memory."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text


def compile_rows(config: Any, devices: Sequence[Any], device_bytes: int, pattern: re.Pattern[str] | None) -> list[Row]:
    """Compiles every program of the run on `devices` (those whose name matches `pattern`), printing
    one progress line per program; returns the table's rows."""
    from scalerl_jax.run.programs import model_config_of, run_programs

    model_config = model_config_of(config)
    stop_tokens, interruption_lengths, source = token_counts(config)
    print(f"model: {model_config.num_params():,} parameters, {model_config.num_layers} layers, {model_config.dtype}")
    print(f"tokens: {source}", flush=True)
    rows = []
    start = time.perf_counter()
    programs = run_programs(
        config, devices, model_config=model_config, stop_tokens=stop_tokens, interruption_lengths=interruption_lengths
    )
    for program in programs:
        aot = program.program
        if pattern is not None and not pattern.search(f"{aot.name} {aot.shape}"):
            continue
        begin = time.perf_counter()
        error = ""
        arguments = temp = peak = 0
        try:
            memory = aot.lower().compile().memory_analysis()
        except Exception as e:  # noqa: BLE001 -- only the compiler's out-of-memory refusal is a result
            if not out_of_memory(e):
                raise
            error = str(e).strip().splitlines()[0]
        else:
            if memory is None:
                raise CompileCheckError(f"{aot.name}: the compiler reports no memory analysis for this target")
            arguments, temp, peak = memory.argument_size_in_bytes, memory.temp_size_in_bytes, peak_bytes(memory)
        row = Row(
            program.role,
            aot.name,
            aot.shape,
            program.devices,
            time.perf_counter() - begin,
            int(arguments),
            int(temp),
            int(peak),
            program.resident_bytes,
            device_bytes,
            error,
        )
        rows.append(row)
        verdict = (
            f"does NOT fit: {error}"
            if error
            else f"peak {row.peak_bytes / GIB:.2f} + resident {row.resident_bytes / GIB:.2f} = "
            f"{row.total_bytes / GIB:.2f} of {device_bytes / GIB:.2f} GiB{'' if row.fits else ': does NOT fit'}"
        )
        print(
            f"[{len(rows):3d}, {time.perf_counter() - start:6.0f} s] {row.role} {row.name} {row.shape}: "
            f"compiled in {row.compile_s:.1f} s, {verdict}",
            flush=True,
        )
    return rows
