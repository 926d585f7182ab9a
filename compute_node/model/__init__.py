"""A decoder model (Llama / Qwen2 / Qwen3, Hugging Face safetensors) on the compute node.

Dense layers run in torch; attention runs only through `kernels` over the node's `KvPool`;
sampling happens here, so logits never leave the node. The public face is `ModelRunner`.
"""

from compute_node.model.batch import SeqOutput, SeqWork
from compute_node.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from compute_node.model.errors import (
    ContextTooLong,
    InvalidBatch,
    InvalidModelConfig,
    InvalidSamplingParams,
    ModelError,
    ModelLoadError,
    ModelNotFound,
    UnsupportedModel,
    WeightsError,
)
from compute_node.model.runner import DebugForward, ModelRunner, StepTimings
from compute_node.model.sampling import MAX_LOGPROBS, SamplingParams, derive_seed, seeded_uniform

__all__ = [
    "MAX_LOGPROBS",
    "SUPPORTED_ARCHITECTURES",
    "ContextTooLong",
    "DebugForward",
    "InvalidBatch",
    "InvalidModelConfig",
    "InvalidSamplingParams",
    "ModelConfig",
    "ModelError",
    "ModelLoadError",
    "ModelNotFound",
    "ModelRunner",
    "SamplingParams",
    "SeqOutput",
    "SeqWork",
    "StepTimings",
    "UnsupportedModel",
    "WeightsError",
    "derive_seed",
    "seeded_uniform",
]
