"""DeepInfer backend for Ascend 950 NPUs (registered as entry point `ascend` in `deepinfer.backends`)."""
