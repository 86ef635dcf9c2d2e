"""Flax NNX decoder (Llama 3 / Qwen2.5 / Qwen3), FP32 head, chunked log-probs, sharding and local
reshard, HF import/export."""

from scalerl_jax.models.config import PRESETS, ModelConfig, get_preset
from scalerl_jax.models.hf import (
    abstract_hf,
    dtype_name,
    load_chat_template,
    load_hf,
    load_hf_config,
    load_tokenizer,
    save_hf,
)
from scalerl_jax.models.hf_tokenizer import CheckpointTokenizer, load_checkpoint_tokenizer
from scalerl_jax.models.logprobs import sequence_logprobs
from scalerl_jax.models.reshard import push_local
from scalerl_jax.models.sharding import (
    DEFAULT_RULES,
    Device,
    constrain,
    logical_to_spec,
    make_mesh,
    param_shardings,
    split_devices,
    use_mesh_rules,
)
from scalerl_jax.models.transformer import Transformer, init_kv_cache, init_transformer, remat_policy

__all__ = [
    "CheckpointTokenizer",
    "DEFAULT_RULES",
    "Device",
    "ModelConfig",
    "PRESETS",
    "Transformer",
    "constrain",
    "get_preset",
    "init_kv_cache",
    "abstract_hf",
    "init_transformer",
    "dtype_name",
    "load_chat_template",
    "load_checkpoint_tokenizer",
    "load_hf",
    "load_hf_config",
    "load_tokenizer",
    "logical_to_spec",
    "make_mesh",
    "param_shardings",
    "push_local",
    "remat_policy",
    "save_hf",
    "sequence_logprobs",
    "split_devices",
    "use_mesh_rules",
]
