"""DeepInfer feature plugin: batch-invariant kernels and deterministic sampling (entry point `batch_invariant` in `deepinfer.features`)."""
