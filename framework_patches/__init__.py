"""PyTorch and TensorFlow patches that put NVTX ranges around ops and modules."""
