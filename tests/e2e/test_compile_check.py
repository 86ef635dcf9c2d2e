"""`python -m scalerl_jax.cli.compile_check`: every program of a run compiled for a TPU topology that is
not attached (libtpu from the test extra), its memory against hand counts, an oversized setting
refused naming the program and its keys, bad input in one line; the GPU route (the CUDA plugin,
too large for CI) as a slow test."""

import importlib.util
import json
import os
import subprocess

import pytest
from repo_paths import REPO

from scalerl_jax.cli import compile_check

pytest.importorskip("libtpu", reason="the TPU compile check needs libtpu (pip install -e '.[tpu]')")


# The tiny recipe's warm-started policy, counted by hand from `recipes.tiny()`'s warm_start
# model_overrides: vocabulary 300, hidden 128, MLP 384, 4 layers, 4 query heads and 2 KV heads of 32.
VOCAB, HIDDEN, MLP, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 300, 128, 384, 4, 4, 2, 32
PER_LAYER = (
    HIDDEN * HEADS * HEAD_DIM  # q
    + 2 * HIDDEN * KV_HEADS * HEAD_DIM  # k, v
    + HEADS * HEAD_DIM * HIDDEN  # o
    + 3 * HIDDEN * MLP  # gate, up, down
    + 2 * HIDDEN  # two RMSNorm scales
)
PARAMS = VOCAB * HIDDEN + LAYERS * PER_LAYER + HIDDEN + HIDDEN * VOCAB  # embedding, layers, final norm, head
F32 = 4
# Its paged KV pool on the one generator device, with `sampler.num_pages=512`: 512 pages of 16 tokens,
# K and V of every layer, float32. (The default, 64 slots x ceil(112 / 16) = 448 pages, is padded
# to 512 by the TPU's memory layout: XLA counts 16,777,216 bytes for it, not 14,680,064.)
KV_PAGES = 512
KV_POOL = KV_PAGES * 16 * LAYERS * KV_HEADS * HEAD_DIM * F32 * 2
SMALL = 64 * 1024  # per-slot fields, page tables, step counters, metrics: far below one parameter copy

# One generator and one trainer device (v5e:1x2), so every per-device count is the whole array.
TINY = [
    "--config=configs/tiny.py",
    "--target=v5e:1x2",
    "--config.batch.prompts_per_step=2",
    "--config.batch.length_buckets_per_octave=1",
]


def run_check(argv, tmp_path, capsys):
    out = tmp_path / "table.json"
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        status = compile_check.main([*argv, f"--out={out}"])
    finally:
        os.chdir(cwd)
    captured = capsys.readouterr()
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    return status, {(r["name"], r["shape"]): r for r in rows}, captured


@pytest.fixture(scope="module")
def tiny_check(tmp_path_factory):
    """Every program of the tiny run (2 microbatches of 8 rows, a 512-page KV pool) on v5e:1x2."""
    out = tmp_path_factory.mktemp("compile_check") / "table.json"
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        status = compile_check.main(
            [*TINY, "--config.batch.microbatches=2", f"--config.sampler.num_pages={KV_PAGES}", f"--out={out}"]
        )
    finally:
        os.chdir(cwd)
    rows = json.loads(out.read_text())["rows"]
    return status, {(r["name"], r["shape"]): r for r in rows}, [r["name"] for r in rows]


def test_hand_count_of_the_tiny_model_is_its_parameter_count():
    assert PARAMS == 864_384  # the size `recipes.tiny`'s docstring states (0.86M)


def test_tiny_run_compiles_for_a_tpu_slice_and_its_memory_matches_a_hand_count(tiny_check):
    status, rows, _ = tiny_check
    assert status == 0
    # The update reads the whole train state (params, Adam's mu and nu: fp32) and the fp32 gradient
    # accumulator: four copies of the parameters, plus scalars.
    update = rows[("train/update", "params")]
    assert 0 <= update["argument_bytes"] - 4 * F32 * PARAMS < SMALL
    assert update["resident_bytes"] == 0
    # A microbatch gradient takes the params and the accumulator; mu and nu stay resident beside it.
    accumulate = rows[("train/accumulate", "R=8 T=32")]
    assert 0 <= accumulate["argument_bytes"] - 2 * F32 * PARAMS < SMALL
    assert 0 <= accumulate["resident_bytes"] - 2 * F32 * PARAMS < SMALL
    # Row preparation takes neither: the whole state is resident.
    assert 0 <= rows[("train/prepare_rows", "B=16")]["resident_bytes"] - 3 * F32 * PARAMS < SMALL
    # A decode chunk reads the generator's params and its whole paged KV pool.
    generate = rows[("generator/generate", "window=112")]
    assert 0 <= generate["argument_bytes"] - (F32 * PARAMS + KV_POOL) < SMALL
    # Beside it (eval.concurrent, the tiny default): the evaluation batcher's KV pool and params and
    # the one evaluated version retained for it.
    assert 0 <= generate["resident_bytes"] - (KV_POOL + 2 * F32 * PARAMS) < SMALL
    for row in rows.values():
        assert row["device_bytes"] == 16 * 10**9  # a v5e chip's 16 GB of HBM
        assert row["peak_bytes"] >= row["argument_bytes"]


def test_every_program_of_the_run_is_compiled(tiny_check):
    _, rows, names = tiny_check
    # Train: prepare, zeros, one gradient per length bucket (32, 64 and 112 = 32 + 80), update.
    assert [shape for name, shape in rows if name == "train/accumulate"] == ["R=8 T=32", "R=8 T=64", "R=8 T=112"]
    assert {"train/prepare_rows", "train/zero_accumulator", "train/update"} <= set(names)
    # Generator: a prefill of prompt pieces per row count (1, 2, 4, 8, 16) and window (one: the
    # minimum 256 capped at max_len 112), a fork of the samples sharing a prompt per row count, one
    # decode window, eviction.
    assert names.count("generator/prefill") == 5
    assert names.count("generator/fork") == 5
    assert names.count("generator/generate") == 1
    assert names.count("generator/evict") == 1
    # Push: one process holds both meshes (push_local), and the trainer's one shard of each leaf is
    # the generator's whole slice: a device-to-device copy, no program.
    assert not [name for name in names if name.startswith("push/")]
    assert len(names) == 3 + 3 + 5 + 5 + 1 + 1


def test_an_oversized_setting_fails_naming_the_program_and_its_keys(tmp_path, capsys):
    # 131,072 slots x 112 tokens of KV = 30 GB on one 16 GB chip.
    status, rows, captured = run_check(
        [*TINY, "--config.sampler.num_slots=131072", "--programs=generate"], tmp_path, capsys
    )
    assert status == 1
    assert "generator/generate window=112" in captured.err
    assert "sampler.num_slots" in captured.err
    (row,) = rows.values()
    assert row["error"] or row["total_bytes"] > row["device_bytes"]


def test_a_bad_target_is_one_line_and_exit_2(tmp_path, capsys):
    status, _, captured = run_check(["--config=configs/tiny.py", "--target=v7x:2"], tmp_path, capsys)
    assert status == 2
    assert captured.err.strip().count("\n") == 0
    assert "--target='v7x:2'" in captured.err


def test_a_missing_extra_is_named_and_exit_2(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    status, _, captured = run_check(TINY, tmp_path, capsys)
    assert status == 2
    assert "pip install -e '.[tpu]'" in captured.err


def test_sizes_that_do_not_split_over_the_devices_are_a_config_error(tmp_path, capsys):
    # 64 slots over 3 generator devices (v5e:2x2 at generator_fraction 0.75): the engine refuses.
    status, _, captured = run_check(
        [
            "--config=configs/tiny.py",
            "--target=v5e:2x2",
            "--config.mesh.generator_fraction=0.75",
            "--programs=generate",
        ],
        tmp_path,
        capsys,
    )
    assert status == 2
    assert "page groups" in captured.err


CUDA_PYTHON = os.environ.get("SCALERL_CUDA_PYTHON", "/work/gpuvenv/bin/python")


@pytest.mark.slow
def test_gpu_route_compiles_the_tiny_run_for_an_h200_node(tmp_path):
    """With JAX's CUDA plugin installed in another environment (`SCALERL_CUDA_PYTHON`)."""
    if not os.path.exists(CUDA_PYTHON):
        pytest.skip(f"no Python with jax[cuda12] at {CUDA_PYTHON} (set SCALERL_CUDA_PYTHON)")
    out = tmp_path / "h200.json"
    result = subprocess.run(
        [
            CUDA_PYTHON,
            "-m",
            "scalerl_jax.cli.compile_check",
            "--config=configs/tiny.py",
            "--target=h200:1x8",
            "--config.batch.length_buckets_per_octave=1",
            f"--out={out}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    update = next(r for r in rows if r["name"] == "train/update")
    # Four trainer GPUs (generator_fraction 0.5 of 8) shard the params over fsdp=4: about a quarter
    # of the four fp32 copies each.
    assert abs(update["argument_bytes"] - 4 * F32 * PARAMS / 4) < 0.05 * 4 * F32 * PARAMS / 4 + SMALL
    assert all(r["device_bytes"] == 141 * 10**9 for r in rows)


# Llama 4 Scout's text decoder (configs/scalerl_scout.py), counted by hand in
# tests/unit/config/test_configs.py; its untied head is float32 (the FP32 head).
SCOUT_PARAMS, SCOUT_HEAD = 107_769_861_120, 202_048 * 5_120


@pytest.mark.slow
def test_the_scout_train_step_compiles_for_a_v5p_slice_and_fits(tmp_path, capsys):
    """configs/scalerl_scout.py:v5p on v5p:4x4x4, the trainer's programs at their largest: the
    microbatch gradient of 16 rows x 16,384 tokens (ragged experts dispatched over fsdp 16 in
    blocks, splash on the folded chunks) fits a v5p chip; the AdamW update takes the bfloat16 body
    and float32 head (2 N + 2 H bytes), the float32 master, mu and nu (12 N) and the float32
    gradient (4 N), over 32 trainer chips."""
    status, rows, captured = run_check(
        [
            "--config=configs/scalerl_scout.py:v5p",
            "--target=v5p:4x4x4",
            "--programs=accumulate R=16 T=16384$|train/update",
        ],
        tmp_path,
        capsys,
    )
    assert status == 0, captured.err[-3000:]
    assert set(rows) == {("train/accumulate", "R=16 T=16384"), ("train/update", "params")}
    hand = (18 * SCOUT_PARAMS + 2 * SCOUT_HEAD) / 32
    assert abs(rows[("train/update", "params")]["argument_bytes"] - hand) < 0.001 * hand
    assert all(not r["error"] and r["total_bytes"] <= r["device_bytes"] for r in rows.values())


def test_a_trainer_over_two_hosts_pushes_by_collective_replication(tmp_path, capsys):
    # v5e:4x4 is 4 hosts of 4 chips; half of the 16 chips train, on hosts 0 and 1, so a generator
    # host's slice (a whole leaf: its params are replicated) is held by no single trainer process
    # and is first replicated over the trainer mesh, as `ParamsSender.offer` does.
    status, rows, captured = run_check(
        [
            "--config=configs/tiny.py",
            "--target=v5e:4x4",
            "--config.batch.length_buckets_per_octave=1",
            "--programs=push",
        ],
        tmp_path,
        capsys,
    )
    assert status == 0, captured.err
    assert "over 4 host process(es)" in captured.out
    replicated = {shape: row for (name, shape), row in rows.items() if name == "push/replicate_slice"}
    assert "(300, 128)->(300, 128)" in replicated  # the embedding, whole
    embedding = replicated["(300, 128)->(300, 128)"]
    assert embedding["role"] == "push:trainer" and embedding["devices"] == 8
    # Every trainer chip ends up holding the whole fp32 embedding: 300 x 128 x 4 bytes.
    assert embedding["peak_bytes"] >= VOCAB * HIDDEN * F32
