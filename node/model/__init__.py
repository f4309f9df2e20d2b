"""Model configuration and loading; the embedded default model and its byte tokenizer."""

from node.model.loading import (
    DEFAULT_MODEL_DIR,
    DTYPES,
    ModelInfo,
    default_config,
    load_causal_lm,
    load_weights_into,
    model_info,
    torch_dtype,
)

__all__ = [
    "DEFAULT_MODEL_DIR",
    "DTYPES",
    "ModelInfo",
    "default_config",
    "load_causal_lm",
    "load_weights_into",
    "model_info",
    "torch_dtype",
]
