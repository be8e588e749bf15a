"""A GPT in plain PyTorch, and the functions that make it tensor-, sequence-, context-, expert- and
pipeline-parallel (parallelize_chunk, parallelize_gpt)."""

from threadpar.models.gpt import GPT, MODEL_SIZES, GPTChunk, GPTConfig, GPTLoss, TensorParallel, model_config
from threadpar.models.parallelize_gpt import HybridGPT, gpt_tp_plan, parallelize_chunk, parallelize_gpt

__all__ = [
    "GPT",
    "MODEL_SIZES",
    "GPTChunk",
    "GPTConfig",
    "GPTLoss",
    "HybridGPT",
    "TensorParallel",
    "gpt_tp_plan",
    "model_config",
    "parallelize_chunk",
    "parallelize_gpt",
]
