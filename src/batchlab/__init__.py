"""batchlab: predict, then measure, then explain batch and activation-checkpointing choices.

Importing batchlab (and batchlab.config / batchlab.formula) does not import torch.
"""
from batchlab.config import ACPolicy, ConfigError, ModelSpec, RunConfig, preset

__version__ = "0.1.0"
__all__ = ["ACPolicy", "ConfigError", "ModelSpec", "RunConfig", "preset", "__version__"]
