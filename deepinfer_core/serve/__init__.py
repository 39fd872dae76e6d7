"""An OpenAI-compatible HTTP server over the engine (`python -m deepinfer_core.serve`); needs the
`server` extra (FastAPI, uvicorn)."""
