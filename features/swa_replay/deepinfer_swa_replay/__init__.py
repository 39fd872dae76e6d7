"""DeepInfer feature plugin: V4.1 SWA bounded replay / YOCO prefill truncation (entry point `swa_replay` in `deepinfer.features`)."""
