"""Start the OpenAI-compatible server on a free local port, talk to it with the `openai` client
(a completion, a streamed chat reply in thinking mode), stop it.

    python examples/openai_client.py [--model PATH]      # default: the bundled tiny model
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    port, key = free_port(), "sk-local"
    cmd = [sys.executable, "-m", "deepinfer_core.serve", "--port", str(port), "--api-key", key,
           "--served-model-name", "tiny", "--max-model-len", "1024"] + (["--model", a.model] if a.model else [])
    server = subprocess.Popen(cmd)
    try:
        deadline = time.time() + 300
        while True:                                   # the server is up when /health answers
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.time() > deadline:
                sys.exit(f"the server did not start (exit status {server.poll()})")
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key)
        done = client.completions.create(model="tiny", prompt="ROMEO.\n", max_tokens=16, temperature=0.0)
        print("completion:", repr(done.choices[0].text))
        reasoning, content = [], []
        for chunk in client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Speak the prologue."}], max_tokens=24,
                stream=True, extra_body={"chat_template_kwargs": {"thinking": True}}):
            delta = chunk.choices[0].delta
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            content.append(delta.content or "")
        print("reasoning:", repr("".join(reasoning)))
        print("answer:", repr("".join(content)))
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
