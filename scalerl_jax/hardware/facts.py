"""One table of accelerator facts: memory, peak dense bf16 FLOP/s, HBM bandwidth, and how JAX names each.

A device is found by a substring of JAX's `device.device_kind` ('NVIDIA H100 80GB HBM3', 'TPU v5 lite');
the table is searched in order and the first substring that occurs wins, so the more specific names come
first ('H100 PCIe' before 'H100', 'GH200' and 'H200 NVL' before 'H200', 'TPU v5 lite' before 'TPU v5').

Units: bytes, FLOP/s and bytes/s, with 1 GB = 1e9 bytes and 1 TB/s = 1e12 bytes/s as the data sheets
write them (GiB = 2^30 bytes where a data sheet says GiB). Memory is the data sheet's capacity, which for
NVIDIA parts is a little below what the device exposes (an 'H100 80GB' shows 81559 MiB = 85.5e9 bytes in
nvidia-smi): a plan that fits the table fits the device. FLOP/s are dense (no 2:4 sparsity).

Sources, by family (the document named is the one each row's numbers come from):
  NVIDIA H100 Tensor Core GPU Datasheet (SXM, PCIe, NVL); NVIDIA H200 Tensor Core GPU product brief (SXM,
  NVL); NVIDIA GH200 Grace Hopper Superchip datasheet; NVIDIA HGX B200 specifications (8-GPU board totals,
  divided by 8); NVIDIA A100 Tensor Core GPU Datasheet; NVIDIA L40S
  GPU datasheet; Google Cloud TPU documentation, "TPU v4", "TPU v5e", "TPU v5p" and "TPU v6e" system
  architecture pages (per-chip HBM capacity, HBM bandwidth, peak bf16 compute).

For TPUs the table also holds what `jax.experimental.topologies.get_topology_desc` needs to describe a
slice without one: the topology name's prefix ('v5e' in 'v5e:4x4'), the chip configuration ('megacore'
where two TensorCores act as one device: v4 and v5p) and the chips of one host ((2, 2, 1): the 4-chip
hosts of multi-host v4, v5e, v5p and v6e slices).
"""

from __future__ import annotations

import dataclasses
import importlib.resources


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """Published facts of one accelerator model (per device as JAX counts devices: a chip, or a
    megacore's two TensorCores)."""

    name: str
    platform: str  # 'gpu' or 'tpu', as `jax.Device.platform` says
    device_kinds: tuple[str, ...]  # substrings of `device.device_kind` that identify it
    memory_bytes: int
    peak_bf16_flops_per_s: float  # dense
    hbm_bytes_per_s: float
    topology_prefix: str | None = None  # TPU: `get_topology_desc(topology_name=f"{prefix}:{shape}")`
    chip_config_name: str | None = None  # TPU: `get_topology_desc(chip_config_name=...)`
    chips_per_host_bounds: tuple[int, int, int] | None = None  # TPU: chips of one host, per axis
    gpu_target_config: str | None = None  # GPU: packaged GpuTargetConfigProto text file, for deviceless compiles

    @property
    def chips_per_host(self) -> int | None:
        """Product of `chips_per_host_bounds` (None off TPU)."""
        if self.chips_per_host_bounds is None:
            return None
        x, y, z = self.chips_per_host_bounds
        return x * y * z


GB = 10**9
GIB = 2**30
TB_S = 1e12
TFLOPS = 1e12
_TPU_HOST = (2, 2, 1)

DEVICES: tuple[DeviceFacts, ...] = (
    # H100 data sheet: SXM 80 GB HBM3 3.35 TB/s; PCIe 80 GB HBM2e 2.0 TB/s; NVL 94 GB HBM3 3.9 TB/s. BF16 dense
    # is half the sheet's sparse figure: 1,979 / 1,513 / 1,671 TFLOPS -> 989 / 756 / 835.
    DeviceFacts("H100 PCIe", "gpu", ("H100 PCIe",), 80 * GB, 756 * TFLOPS, 2.0 * TB_S),
    DeviceFacts("H100 NVL", "gpu", ("H100 NVL",), 94 * GB, 835 * TFLOPS, 3.9 * TB_S),
    DeviceFacts(
        "H100 SXM 80GB",
        "gpu",
        ("H100",),  # e.g. 'NVIDIA H100 80GB HBM3'
        80 * GB,
        989 * TFLOPS,
        3.35 * TB_S,
        gpu_target_config="h100_sxm_80gb.txtpb",
    ),
    # H200 product brief: SXM and NVL both 141 GB HBM3e at 4.8 TB/s; BF16 sparse 1,979 (SXM) / 1,671 (NVL) TFLOPS.
    DeviceFacts("H200 NVL", "gpu", ("H200 NVL",), 141 * GB, 835 * TFLOPS, 4.8 * TB_S),
    # GH200 data sheet (96 GB HBM3 version): 4 TB/s, BF16 1,979 TFLOPS sparse. 'GH200' contains 'H200': first.
    DeviceFacts("GH200 96GB", "gpu", ("GH200",), 96 * GB, 989 * TFLOPS, 4.0 * TB_S),
    DeviceFacts(
        "H200 SXM 141GB",
        "gpu",
        ("H200",),  # 'NVIDIA H200'
        141 * GB,
        989 * TFLOPS,
        4.8 * TB_S,
        gpu_target_config="h200_sxm_141gb.txtpb",
    ),
    # HGX B200 specifications over its 8 GPUs: 1,440 GB HBM3e, 64 TB/s, FP16/BF16 36 PFLOPS with sparsity,
    # so per GPU 180 GB, 8 TB/s and 36 / 8 / 2 = 2.25 PFLOPS dense.
    DeviceFacts("B200", "gpu", ("B200",), 180 * GB, 2250 * TFLOPS, 8.0 * TB_S),
    # A100 data sheet: 80 GB HBM2e at 2,039 GB/s (SXM) / 1,935 GB/s (PCIe); 40 GB HBM2 at 1,555 GB/s; BF16 312.
    DeviceFacts("A100 SXM 80GB", "gpu", ("A100-SXM4-80GB",), 80 * GB, 312 * TFLOPS, 2.039 * TB_S),
    DeviceFacts("A100 PCIe 80GB", "gpu", ("A100 80GB PCIe",), 80 * GB, 312 * TFLOPS, 1.935 * TB_S),
    DeviceFacts("A100 40GB", "gpu", ("A100",), 40 * GB, 312 * TFLOPS, 1.555 * TB_S),
    # L40S data sheet: 48 GB GDDR6 at 864 GB/s; BF16 362.05 TFLOPS dense (733 with sparsity).
    DeviceFacts("L40S", "gpu", ("L40S",), 48 * GB, 362.05 * TFLOPS, 0.864 * TB_S),
    # Cloud TPU pages: v4 32 GiB at 1,200 GB/s, 275 TFLOPS; v5e 16 GB at 819 GB/s, 197 TFLOPS; v5p 95 GB at
    # 2,765 GB/s, 459 TFLOPS; v6e 32 GB at 1,640 GB/s, 918 TFLOPS. JAX names v5e 'TPU v5 lite', v5p 'TPU v5'
    # and v6e 'TPU v6 lite' (read from deviceless topologies: tests/unit/hardware/test_hardware_facts.py).
    DeviceFacts("TPU v4", "tpu", ("TPU v4",), 32 * GIB, 275 * TFLOPS, 1.2 * TB_S, "v4", "megacore", _TPU_HOST),
    DeviceFacts(
        "TPU v5e", "tpu", ("TPU v5 lite", "TPU v5e"), 16 * GB, 197 * TFLOPS, 0.819 * TB_S, "v5e", "default", _TPU_HOST
    ),
    DeviceFacts(
        "TPU v5p", "tpu", ("TPU v5p", "TPU v5"), 95 * GB, 459 * TFLOPS, 2.765 * TB_S, "v5", "megacore", _TPU_HOST
    ),
    DeviceFacts(
        "TPU v6e", "tpu", ("TPU v6 lite", "TPU v6e"), 32 * GB, 918 * TFLOPS, 1.64 * TB_S, "v6e", "default", _TPU_HOST
    ),
)

# Short names of the compile-check targets: the 8B run's H100 / H200 nodes and TPU slices.
TARGETS: dict[str, str] = {
    "h100": "H100 SXM 80GB",
    "h200": "H200 SXM 141GB",
    "v4": "TPU v4",
    "v5e": "TPU v5e",
    "v5p": "TPU v5p",
    "v6e": "TPU v6e",
}


def facts_for_device_kind(device_kind: str) -> DeviceFacts | None:
    """The first row of `DEVICES` one of whose `device_kinds` occurs in `device_kind`; None if none
    does (CPU, or a device the table does not know)."""
    for facts in DEVICES:
        if any(kind in device_kind for kind in facts.device_kinds):
            return facts
    return None


def facts_by_name(name: str) -> DeviceFacts:
    """The row whose `name` is `name` (e.g. 'H200 SXM 141GB'); ValueError listing the names otherwise."""
    for facts in DEVICES:
        if facts.name == name:
            return facts
    raise ValueError(f"unknown device {name!r}; known: {', '.join(f.name for f in DEVICES)}")


def facts_for_target(target: str) -> DeviceFacts:
    """Facts of a compile-check target's short name ('h100', 'h200', 'v4', 'v5e', 'v5p', 'v6e');
    ValueError listing the known names otherwise."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; known targets: {', '.join(TARGETS)}")
    return facts_by_name(TARGETS[target])


def gpu_target_config_text(facts: DeviceFacts) -> str:
    """The packaged XLA GpuTargetConfigProto text of a GPU row, for
    `jax.experimental.topologies.get_topology_desc(platform='cuda', target_config=...)`; ValueError
    for a row without one (TPUs, GPUs the 8B run does not target)."""
    if facts.gpu_target_config is None:
        with_files = ", ".join(f.name for f in DEVICES if f.gpu_target_config)
        raise ValueError(f"no GPU target description for {facts.name!r}; packaged for: {with_files}")
    return importlib.resources.files("scalerl_jax.hardware").joinpath(facts.gpu_target_config).read_text()
