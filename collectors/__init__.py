"""Collectors: NVTX capture (the injection library), NVML sampler, host sampler."""
