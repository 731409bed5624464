"""Runtime: split graph execution, CUDA graph capture and replay, memory pools, counters."""
