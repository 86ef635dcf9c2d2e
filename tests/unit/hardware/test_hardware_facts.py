"""hardware.facts: data-sheet numbers by JAX device kind and by target name, the packaged GPU target
descriptions against the table, and the device kinds JAX's deviceless TPU topologies report."""

import importlib.util
import re

import pytest

from scalerl_jax.hardware import facts as hw


@pytest.mark.parametrize(
    "device_kind, name, peak, memory, bandwidth",
    [
        # NVIDIA H100 datasheet: SXM BF16 1,979 TFLOPS with sparsity -> 989 dense; 80 GB; 3.35 TB/s.
        ("NVIDIA H100 80GB HBM3", "H100 SXM 80GB", 989e12, 80e9, 3.35e12),
        # PCIe: 1,513 sparse -> 756 dense, 2 TB/s; NVL: 1,671 -> 835, 94 GB, 3.9 TB/s.
        ("NVIDIA H100 PCIe", "H100 PCIe", 756e12, 80e9, 2.0e12),
        ("NVIDIA H100 NVL", "H100 NVL", 835e12, 94e9, 3.9e12),
        # NVIDIA H200 product brief: 141 GB HBM3e at 4.8 TB/s; SXM 989 dense, NVL 835 dense.
        ("NVIDIA H200", "H200 SXM 141GB", 989e12, 141e9, 4.8e12),
        ("NVIDIA H200 NVL", "H200 NVL", 835e12, 141e9, 4.8e12),
        # GH200 contains 'H200' but is its own part: 96 GB HBM3 at 4 TB/s.
        ("NVIDIA GH200 480GB", "GH200 96GB", 989e12, 96e9, 4.0e12),
        # HGX B200 over 8 GPUs: 1,440 GB, 64 TB/s, 36 PFLOPS BF16 sparse -> 180 GB, 8 TB/s, 2.25 PFLOPS dense each.
        ("NVIDIA B200", "B200", 2.25e15, 180e9, 8.0e12),
        # NVIDIA A100 datasheet: BF16 312 TFLOPS; 80 GB at 2,039 GB/s (SXM), 1,935 GB/s (PCIe); 40 GB at 1,555 GB/s.
        ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB", 312e12, 80e9, 2.039e12),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB", 312e12, 80e9, 1.935e12),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312e12, 40e9, 1.555e12),
        # NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense, 48 GB GDDR6 at 864 GB/s.
        ("NVIDIA L40S", "L40S", 362.05e12, 48e9, 864e9),
        # Cloud TPU system architecture pages (per chip).
        ("TPU v4", "TPU v4", 275e12, 32 * 2**30, 1200e9),
        ("TPU v5 lite", "TPU v5e", 197e12, 16e9, 819e9),
        ("TPU v5", "TPU v5p", 459e12, 95e9, 2765e9),
        ("TPU v6 lite", "TPU v6e", 918e12, 32e9, 1640e9),
    ],
)
def test_facts_by_device_kind_are_the_data_sheets(device_kind, name, peak, memory, bandwidth):
    facts = hw.facts_for_device_kind(device_kind)
    assert facts is not None and facts.name == name
    assert facts.peak_bf16_flops_per_s == pytest.approx(peak, rel=1e-12)
    assert facts.memory_bytes == memory
    assert facts.hbm_bytes_per_s == pytest.approx(bandwidth, rel=1e-12)


def test_unknown_kinds_have_no_facts():
    assert hw.facts_for_device_kind("cpu") is None
    assert hw.facts_for_device_kind("TFRT_CPU_0") is None


def test_every_row_is_reachable_by_its_own_kinds():
    # A row shadowed by an earlier, more general substring could never be found: each row's own
    # device_kinds must lead back to it.
    for facts in hw.DEVICES:
        for kind in facts.device_kinds:
            assert hw.facts_for_device_kind(kind) is facts, (facts.name, kind)


def test_targets_by_short_name():
    assert hw.facts_for_target("h100").name == "H100 SXM 80GB"
    assert hw.facts_for_target("h200").name == "H200 SXM 141GB"
    v5e, v5p, v6e, v4 = (hw.facts_for_target(t) for t in ("v5e", "v5p", "v6e", "v4"))
    assert (v5e.topology_prefix, v5e.chip_config_name) == ("v5e", "default")
    assert (v5p.topology_prefix, v5p.chip_config_name) == ("v5", "megacore")
    assert (v6e.topology_prefix, v6e.chip_config_name) == ("v6e", "default")
    assert (v4.topology_prefix, v4.chip_config_name) == ("v4", "megacore")
    assert {f.chips_per_host for f in (v4, v5e, v5p, v6e)} == {4}
    assert hw.facts_for_target("h100").chips_per_host is None
    with pytest.raises(ValueError, match="known targets: h100, h200, v4, v5e, v5p, v6e"):
        hw.facts_for_target("a100")


def _field(text: str, name: str) -> str:
    """The value of the one `name: value` line of a protobuf text file."""
    values = re.findall(rf"^\s*{name}:\s*(.+?)\s*$", text, flags=re.MULTILINE)
    assert len(values) == 1, (name, values)
    return values[0]


@pytest.mark.parametrize("target, description", [("h100", '"NVIDIA H100 80GB HBM3"'), ("h200", '"NVIDIA H200"')])
def test_gpu_target_description_agrees_with_the_table(target, description):
    facts = hw.facts_for_target(target)
    text = hw.gpu_target_config_text(facts)
    assert int(_field(text, "device_memory_size")) == facts.memory_bytes
    assert int(_field(text, "memory_bandwidth")) == facts.hbm_bytes_per_s
    # H100 / H200 SXM: 132 SMs, 50 MiB L2 = 52,428,800 B, 228 KiB = 233,472 B shared memory per SM,
    # compute capability 9.0; and JAX reports the description string as the device kind, which must
    # lead back to this row.
    assert int(_field(text, "core_count")) == 132
    assert int(_field(text, "l2_cache_size")) == 52_428_800
    assert int(_field(text, "shared_memory_per_core")) == 233_472
    assert re.search(r"cuda_compute_capability\s*{\s*major:\s*9\s+minor:\s*0\s*}", text)
    assert _field(text, "platform_name") == '"CUDA"'
    assert _field(text, "device_description_str") == description
    assert hw.facts_for_device_kind(description.strip('"')) is facts


def test_no_gpu_target_description_for_tpus():
    with pytest.raises(ValueError, match="packaged for: H100 SXM 80GB, H200 SXM 141GB"):
        hw.gpu_target_config_text(hw.facts_for_target("v5e"))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
@pytest.mark.parametrize(
    "target, shape, kind, devices",
    [
        ("v5e", "2x2", "TPU v5 lite", 4),
        ("v5p", "2x2x2", "TPU v5", 8),  # megacore: one device per chip
        ("v6e", "2x2", "TPU v6 lite", 4),
        ("v4", "2x2x2", "TPU v4", 8),
    ],
)
def test_deviceless_tpu_topologies_report_the_kinds_the_table_maps(target, shape, kind, devices, monkeypatch):
    from jax.experimental import topologies

    # libtpu takes a one-process-per-host lock (/tmp/libtpu_lockfile) unless told not to; a deviceless
    # topology uses no chip, and another process on the machine may hold the lock.
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

    facts = hw.facts_for_target(target)
    assert facts.topology_prefix is not None and facts.chip_config_name is not None
    assert facts.chips_per_host_bounds is not None
    topology = topologies.get_topology_desc(
        topology_name=f"{facts.topology_prefix}:{shape}",
        platform="tpu",
        chip_config_name=facts.chip_config_name,
        chips_per_host_bounds=facts.chips_per_host_bounds,
        num_slices=1,
        wrap=(False, False, False),
    )
    assert len(topology.devices) == devices
    assert {(d.device_kind, d.platform) for d in topology.devices} == {(kind, "tpu")}
    assert hw.facts_for_device_kind(kind) is facts
