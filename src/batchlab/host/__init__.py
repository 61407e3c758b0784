"""What this machine is, and how batchlab's CPU measuring processes are started and kept steady."""
from __future__ import annotations

from batchlab.host.machine import (cpu_hardware, cpu_name, cpu_peak_flops, cpu_vector_flops_per_cycle, free_port,
                                   gpu_names, memory_bytes)

__all__ = ["cpu_hardware", "cpu_name", "cpu_peak_flops", "cpu_vector_flops_per_cycle", "free_port", "gpu_names",
           "memory_bytes"]
