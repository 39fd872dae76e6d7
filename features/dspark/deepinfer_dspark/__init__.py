"""DeepInfer feature plugin: DSpark speculative decoding (drafter, confidence head, verify-length scheduling) (entry point `dspark` in `deepinfer.features`)."""
