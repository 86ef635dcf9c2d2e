"""SmolLM2-135M-Instruct (or any small Hugging Face instruct model) on GSM8K, on one CPU:

`python -m scalerl_jax.main --config=configs/smollm2_gsm8k.py --config.model.checkpoint=DIR
--config.data.path=../shared/data/gsm8k/train.jsonl --workdir=runs/smollm2`
"""

from scalerl_jax.config import recipes


def get_config():
    return recipes.smollm2_gsm8k()
