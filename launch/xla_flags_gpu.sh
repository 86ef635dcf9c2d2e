# Source this file before launching on NVIDIA GPUs: `source launch/xla_flags_gpu.sh`.
# The flags follow the JAX "GPU performance tips" page and the JAX-Toolbox / MaxText GPU guides.
# Flag names and defaults depend on the jaxlib version: check them against
# xla/debug_options_flags.cc of the jaxlib you run, and drop any your version rejects.

flags=(
  # Let the scheduler move collectives so they overlap with compute (FSDP all-gathers,
  # gradient reduce-scatters): the single most important flag for multi-GPU training.
  --xla_gpu_enable_latency_hiding_scheduler=true
  # Combine small collectives into large ones (fewer NCCL launches). 128 MiB / 1 GiB are the
  # values the JAX-Toolbox guides use for LLM training; lower them if memory is tight.
  --xla_gpu_all_gather_combine_threshold_bytes=134217728
  --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728
  --xla_gpu_all_reduce_combine_threshold_bytes=1073741824
  # Pipeline the per-layer collectives of a scanned layer stack across loop iterations so
  # layer i+1's weights are gathered while layer i computes.
  --xla_gpu_enable_pipelined_all_gather=true
  --xla_gpu_enable_pipelined_reduce_scatter=true
  --xla_gpu_enable_pipelined_all_reduce=true
  # Double-buffer while loops (our scan over layers and over microbatches) so the pipelined
  # collectives above have a buffer to prefetch into.
  --xla_gpu_enable_while_loop_double_buffering=true
  # Keep combining by dimension off: it splits combines that the thresholds above would merge.
  --xla_gpu_enable_all_gather_combine_by_dim=false
  --xla_gpu_enable_reduce_scatter_combine_by_dim=false
)
export XLA_FLAGS="${XLA_FLAGS:-} ${flags[*]}"

# Let XLA take most of the HBM up front (NCCL and cuBLAS workspaces need the rest).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
# NVLink SHARP off: it has caused hangs with some NCCL versions; turn it on once yours is known good.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
