"""DeepInfer backend for NVIDIA GPUs (registered as entry point `nvidia` in `deepinfer.backends`)."""
