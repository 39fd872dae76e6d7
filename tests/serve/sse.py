"""The server tests' SSE reader: a streamed request's events, parsed, without the final [DONE]."""
from __future__ import annotations

import json

import httpx


def events(url: str, route: str, body: dict, model: str = "tiny") -> list[dict]:
    body = {"model": model, "stream": True, **body}
    with httpx.stream("POST", f"{url}/v1/{route}", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]
