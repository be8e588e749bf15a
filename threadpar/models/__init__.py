"""Models built from threadpar's layers: a GPT that is tensor-, sequence-, context-, expert- and
pipeline-parallel."""

from threadpar.models.gpt import GPT, MODEL_SIZES, GPTChunk, GPTConfig, GPTLoss, TensorParallel, model_config
from threadpar.models.parallelize_gpt import HybridGPT, parallelize_gpt

__all__ = [
    "GPT",
    "MODEL_SIZES",
    "GPTChunk",
    "GPTConfig",
    "GPTLoss",
    "HybridGPT",
    "TensorParallel",
    "model_config",
    "parallelize_gpt",
]
