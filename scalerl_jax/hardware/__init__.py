"""Published accelerator facts (memory, peak FLOP/s, bandwidth, JAX's names) and XLA GPU target
descriptions for compiling without the device. Imports no other part of scalerl_jax."""

from scalerl_jax.hardware.facts import (
    DEVICES,
    TARGETS,
    DeviceFacts,
    facts_by_name,
    facts_for_device_kind,
    facts_for_target,
    gpu_target_config_text,
)

__all__ = [
    "DEVICES",
    "TARGETS",
    "DeviceFacts",
    "facts_by_name",
    "facts_for_device_kind",
    "facts_for_target",
    "gpu_target_config_text",
]
