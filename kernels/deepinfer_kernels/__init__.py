"""Triton kernels for DeepInfer's NVIDIA backend (SM90 and SM100). Each kernel has a pure-PyTorch
reference in `deepinfer_core` and a test against it (`tests/kernels`, run under TRITON_INTERPRET=1
on CPU in CI and compiled on a GPU with `-m gpu`)."""
