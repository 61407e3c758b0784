"""batchlab: predict, then measure, then explain batch and activation-checkpointing choices.

Importing batchlab (and batchlab.config / batchlab.formula) does not import torch.
"""
from batchlab.config import ACPolicy, ConfigError, ModelSpec, RunConfig, preset

__version__ = "0.1.0"
__all__ = ["ACPolicy", "ConfigError", "ModelSpec", "RunConfig", "observe", "preset", "__version__"]


def __getattr__(name: str):
    # torch-side helpers load on first use, so `import batchlab` stays torch-free
    if name == "observe":
        from batchlab.integrations.observe import observe

        return observe
    raise AttributeError(f"module 'batchlab' has no attribute {name!r}")
