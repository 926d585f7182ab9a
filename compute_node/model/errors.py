"""Typed errors of the model runner.

Two families, because the caller reacts differently to each:
- `ModelLoadError` (and its subclasses) is raised while a node starts: the model directory is
  missing, incomplete or describes something this runner cannot run. Nothing is served.
- `InvalidBatch` is raised by `ModelRunner.execute` *before* anything is written to the KV
  pool: the step was malformed (the scheduler's bug, gRPC INVALID_ARGUMENT); the pool and every
  other sequence are untouched, so the caller may drop the offending sequence and retry.

They deliberately carry no gRPC status: this package sits below the servicer, which maps them
(`InvalidBatch` → INVALID_ARGUMENT, `ModelLoadError` → a failed start).
"""

from __future__ import annotations


class ModelError(Exception):
    """Base of every error raised by `compute_node.model`."""


class ModelLoadError(ModelError):
    """The model directory cannot be loaded."""


class ModelNotFound(ModelLoadError):
    """The directory or its `config.json` does not exist."""


class InvalidModelConfig(ModelLoadError):
    """`config.json` (or `generation_config.json`) is unreadable or inconsistent."""


class UnsupportedModel(ModelLoadError):
    """The config describes an architecture or feature this runner does not implement."""


class WeightsError(ModelLoadError):
    """Safetensors files are missing, unreadable, or lack (or mis-shape) a tensor the model needs."""


class InvalidBatch(ModelError, ValueError):
    """A step's batch is malformed; raised before the KV pool is touched."""


class ContextTooLong(InvalidBatch):
    """A sequence's positions would run past the model's maximum context length."""


class InvalidSamplingParams(InvalidBatch):
    """Sampling parameters out of range (temperature, top-p, top-k, min-p, logprobs)."""
