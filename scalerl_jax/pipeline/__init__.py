"""PipelineRL-k and PPO-off-policy-k: generator and trainer threads around a bounded group buffer.

`lag.py` (which groups may be admitted / trained: the lag bound), `queue.py` (the thread-safe
buffer), `batching.py` (groups -> padded train batch), `generator.py` (the generator loop and its
link to the buffer), `config.py` (`PipelineConfig`), `pipeline_rl.py` (the threads, weight push,
stopping and clean failure), `step_record.py` (what each step reports: `StepRecord` and the
pipeline's metrics), `sim.py` (discrete-event cluster simulator).

This package starts the run's generator, scoring and trainer threads (`pipeline_rl.py`). Threads
are also started by the composition root (`run/build.py`: the train step's ahead-of-time compiles;
`run/evaluation.py`: evaluations; `run/processes.py`: a follower's generator, a generator's
params inbox), by `distributed/` (`watchdog.py`: heartbeats; `weight_push.py`: params pulls) and
by the `evaluate` entry point (its progress line). The lower packages (`rl`, `models`, `sampler`,
`train`, `data`) start none.
"""

from scalerl_jax.pipeline.batching import build_train_batch, pick_bucket, power_of_two_buckets
from scalerl_jax.pipeline.config import PipelineConfig
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
from scalerl_jax.pipeline.pipeline_rl import EvalSampler, Pipeline, PipelineResult, SampleEval
from scalerl_jax.pipeline.queue import BufferCounts, GroupBuffer, PipelineStopped, WaitTimes
from scalerl_jax.pipeline.sim import ClusterSpec, SimResult, simulate
from scalerl_jax.pipeline.step_record import StepRecord

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
