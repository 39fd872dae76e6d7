"""DeepInfer backend for Ascend NPUs (entry point `ascend` in `deepinfer.backends`)."""
