"""An example third-party DeepInfer feature plugin: forbid words and phrases per request.

A request asks for it with `SamplingParams(extra_args={"banned_words": ["thee", "thou"]})` (or the
server's `extra_args` / `vllm_xargs` body field). Layout:

  plugin.py        the entry point (`banned_words` in `deepinfer.features`): one @hookimpl
  banned_words.py  the request's settings and the token matching (plain Python, no torch)
  processor.py     the LogitsProcessor the engine calls (deepinfer_core/engine/constraints.py)
"""
