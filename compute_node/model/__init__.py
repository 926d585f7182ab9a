"""A decoder model (Llama / Qwen2 / Qwen3, Hugging Face safetensors) on the compute node.

Dense layers run in torch; attention runs only through `kernels` over the node's `KvPool`;
sampling happens here, so logits never leave the node. The public face is `ModelRunner`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compute_node.model.batch import PromptLogprobs, PromptLogprobsRequest, SeqOutput, SeqWork, StepResult
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

# Names resolve on first use (PEP 562), so importing `compute_node.model.config` or `.errors`
# (a CLI checking a model directory) does not import the runner and torch with them.
_SOURCES = {
    "batch": ("PromptLogprobs", "PromptLogprobsRequest", "SeqOutput", "SeqWork", "StepResult"),
    "config": ("SUPPORTED_ARCHITECTURES", "ModelConfig"),
    "errors": ("ContextTooLong", "InvalidBatch", "InvalidModelConfig", "InvalidSamplingParams", "ModelError",
               "ModelLoadError", "ModelNotFound", "UnsupportedModel", "WeightsError"),
    "runner": ("DebugForward", "ModelRunner", "StepTimings"),
    "sampling": ("MAX_LOGPROBS", "SamplingParams", "derive_seed", "seeded_uniform"),
}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


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
    "PromptLogprobs",
    "PromptLogprobsRequest",
    "SamplingParams",
    "SeqOutput",
    "SeqWork",
    "StepResult",
    "StepTimings",
    "UnsupportedModel",
    "WeightsError",
    "derive_seed",
    "seeded_uniform",
]
