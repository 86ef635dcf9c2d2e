"""PipelineRL-k and PPO-off-policy-k: generator and trainer threads around a bounded group buffer.

`lag.py` (which groups may be admitted / trained: the lag bound), `queue.py` (the thread-safe
buffer), `batching.py` (groups -> padded train batch), `generator.py` (the generator loop and its
link to the buffer), `pipeline_rl.py` (the threads, weight push, metrics, clean failure and signals), `sim.py` (discrete-event cluster simulator).
Only this package (and `main`) uses threads.
"""

from scalerl_jax.pipeline.batching import build_train_batch, pick_bucket, power_of_two_buckets
from scalerl_jax.pipeline.generator import (
    Admission,
    GeneratorLink,
    GeneratorLoop,
    GeneratorStats,
    LocalLink,
    evaluation_seed,
    request_seed,
)
from scalerl_jax.pipeline.group import Group, Prompt, lags
from scalerl_jax.pipeline.lag import (
    PipelineSchedule,
    PPOOffPolicySchedule,
    Schedule,
    Ticket,
    default_capacity,
    make_schedule,
)
from scalerl_jax.pipeline.pipeline_rl import (
    EvalSampler,
    Pipeline,
    PipelineConfig,
    PipelineResult,
    SampleEval,
    StepRecord,
)
from scalerl_jax.pipeline.queue import BufferCounts, GroupBuffer, PipelineStopped, WaitTimes
from scalerl_jax.pipeline.sim import ClusterSpec, SimResult, simulate

__all__ = [
    "Admission",
    "BufferCounts",
    "ClusterSpec",
    "GeneratorLink",
    "GeneratorLoop",
    "GeneratorStats",
    "Group",
    "EvalSampler",
    "GroupBuffer",
    "PPOOffPolicySchedule",
    "LocalLink",
    "Pipeline",
    "PipelineConfig",
    "PipelineResult",
    "PipelineSchedule",
    "PipelineStopped",
    "Prompt",
    "SampleEval",
    "Schedule",
    "SimResult",
    "StepRecord",
    "Ticket",
    "WaitTimes",
    "build_train_batch",
    "default_capacity",
    "evaluation_seed",
    "lags",
    "make_schedule",
    "pick_bucket",
    "power_of_two_buckets",
    "request_seed",
    "simulate",
]
