"""DeepInfer feature plugin: structured outputs (grammar-constrained decoding) (entry point `structured_outputs` in `deepinfer.features`)."""
