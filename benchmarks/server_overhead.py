"""What the OpenAI server adds to time to first token, with a model that computes nothing.

N prompts of L random token ids go to a stand-in runner (`NullRunner`: it samples token 7 from
constant logits and keeps no state, so every millisecond measured is the host's) twice: through
`LLM.generate` (all added at once) and through the server (the engine in a thread of this process,
as `--no-engine-process`; every request sent at once as a streamed `/v1/completions` with a token-id
prompt and `return_token_ids`, from a client process of its own). Runs on a CPU; the difference is
the server's host path for such a burst (HTTP, parsing and validating the bodies, handing requests
to the engine thread, encoding the events), which a GPU's forward does not hide. `--step-ms`
makes each step sleep what a device's forward would take; `--follow-up N` turns prefix caching on
and times a chat's second turn (each prompt again + its output + N new ids: the cached history is
restored and only the new tokens run, as `benchmarks/prefix_cache.py` measures on a GPU). Prints
a table and writes benchmarks/results/server_overhead_<label>.json.

    python benchmarks/server_overhead.py [--requests 64] [--prompt-len 6000] [--repeats 3]
    python benchmarks/server_overhead.py --prompt-len 5000 --output-len 32 --follow-up 64 \
        --step-ms 8,8 --max-num-batched-tokens 8192 --label x86_64_follow_up
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import prefix_cache_server as PS
import serve_bench_http as SH
import torch

from deepinfer_core import LLM, SamplingParams
from deepinfer_core.cache.block_allocator import BlockAllocator
from deepinfer_core.ops.sampler import Sampler

REPO = Path(__file__).resolve().parents[1]
VOCAB = 1000           # small, so that sampling costs nothing either


class NullCache:
    """Slots and blocks counted, no tensors (the server's cache-bytes gauge reads `nbytes`)."""

    layout = SimpleNamespace(block_size=128)

    def __init__(self, blocks: int, slots: int):
        self.shape = (blocks, slots)
        self.allocator = BlockAllocator(blocks, slots)

    def nbytes(self) -> int:
        return 0


class NullRunner:
    """The runner contract (deepinfer_core/contracts.py EngineRunner) with nothing computed: every
    logit row says token 7; the cache is a block counter. `step_ms` (base, per 1,000 tokens): a
    step sleeps that long, as a device's forward would keep the engine waiting (the GIL free)."""

    device, dtype = "cpu", torch.float32
    sampler = Sampler()
    logits_processors: list = []
    scheduler_policy = None
    profile_tokens = None
    checkpoint_slots = 0

    def __init__(self, max_len: int, step_ms: tuple[float, float] = (0.0, 0.0)):
        self.step_ms = step_ms
        self.model_config = SimpleNamespace(vocab_size=VOCAB, eos_token_id=1, bos_token_id=0,
                                            max_position_embeddings=max_len)
        self.model = torch.nn.Linear(1, 1)        # the server's weight-bytes gauge reads it
        self.last_token = torch.zeros(4096, dtype=torch.long)
        self.cache = None
        self._row = torch.zeros(VOCAB)
        self._row[7] = 1.0

    def allocate_cache(self, request):
        """A block counter of the size asked for (with prefix caching, its checkpoint slots too:
        the state they would hold is not kept), the same one while the request is unchanged."""
        blocks = request.num_blocks or request.num_slots * -(-request.max_model_len // 128)
        slots = request.num_slots + request.checkpoint_slots
        if self.cache is None or self.cache.shape != (blocks, slots):
            self.cache = NullCache(blocks, slots)
            self.checkpoint_slots = request.checkpoint_slots
        return self.cache

    def make_speculator(self):
        return None

    def execute(self, batch) -> torch.Tensor:
        base, per_1k = self.step_ms
        if base or per_1k:
            time.sleep((base + per_1k * len(batch.ids) / 1000) / 1000)
        return self._row.expand(len(batch.logit_rows), VOCAB)


@contextlib.contextmanager
def serving(llm, max_requests: int) -> Iterator[str]:
    """An OpenAI server over `llm` in this process while the block runs (the engine loop's thread
    and uvicorn's, on a free port: `deepinfer serve --no-engine-process`); its URL."""
    import uvicorn

    from deepinfer_core.serve.app import build_app
    from deepinfer_core.serve.engine_loop import EngineLoop

    loop = EngineLoop(llm.serving_engine(), max_requests=max_requests)
    loop.start()
    server = uvicorn.Server(uvicorn.Config(build_app(llm, loop, PS.MODEL), host="127.0.0.1",
                                           port=SH.free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, name="server-overhead", daemon=True)
    thread.start()
    try:
        deadline = time.perf_counter() + 60
        while not server.started:
            if not thread.is_alive() or time.perf_counter() > deadline:
                raise RuntimeError("server_overhead: the server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)
        loop.stop(30)


def ttfts(outs) -> list[float]:
    return [(o.metrics.first_token_time - o.metrics.arrival_time) * 1e3 for o in outs]


def measure(a: argparse.Namespace) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    longest = a.prompt_len + a.output_len + (a.output_len + a.follow_up if a.follow_up else 0)
    llm = LLM.from_runner(NullRunner(longest, a.step_ms), tokenizer=None, max_num_seqs=a.requests,
                          max_model_len=longest, enable_prefix_caching=bool(a.follow_up),
                          max_num_batched_tokens=a.max_num_batched_tokens
                          or a.requests * longest)
    params = SamplingParams(max_tokens=a.output_len, ignore_eos=True)

    cached: dict[str, int] = {}

    def timed(path: str, turn, reset) -> float:
        """The p50 TTFT of one burst; --follow-up: of the second turn, after a first one (its
        cached prompt tokens kept in `cached`)."""
        outs = turn(prompts)
        if a.follow_up:
            outs = turn([p + list(o.outputs[0].token_ids) + [5] * a.follow_up
                         for p, o in zip(prompts, outs)])
            reset()
        cached[path] = sum(o.num_cached_tokens for o in outs)
        return statistics.median(ttfts(outs))

    def offline(ps: list[list[int]]) -> list:
        return llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)

    generate = [timed("generate", offline, llm.reset_prefix_cache)
                for _ in range(a.repeats + 1)]                 # the first is a warm-up
    with PS.client() as pool, serving(llm, a.requests) as url:
        served = [timed("server", lambda ps: PS.send_turn(pool, url, ps, a.output_len)[0],
                        lambda: httpx.post(f"{url}/reset_prefix_cache").raise_for_status())
                  for _ in range(a.repeats + 1)]
    return {"generate_ttft_ms_p50": generate[1:], "server_ttft_ms_p50": served[1:],
            "cached_tokens": cached}


def step_ms(text: str) -> tuple[float, float]:
    parts = [float(x) for x in text.split(",")]
    if len(parts) != 2 or min(parts) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: BASE,PER_1K, two numbers >= 0 (ms)")
    return parts[0], parts[1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=6000)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-ms", type=step_ms, default=(0.0, 0.0), metavar="BASE,PER_1K",
                   help="each step sleeps BASE + PER_1K x its tokens / 1000 ms, as a device's "
                        "forward would (default 0,0: the host's time alone)")
    p.add_argument("--follow-up", type=int, default=0, metavar="N",
                   help="prefix caching on, and the time measured is a second turn's: each prompt "
                        "again + its output + N new ids, as a chat's next turn (default 0: one "
                        "turn, caching off)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the step's token budget (default: every prompt in one step)")
    p.add_argument("--label", default=platform.machine())
    p.add_argument("--json", default=None, help="result path (default: benchmarks/results/"
                   "server_overhead_<label>.json)")
    a = p.parse_args(argv)
    res = measure(a)
    gen, srv = (statistics.median(res[k]) for k in ("generate_ttft_ms_p50", "server_ttft_ms_p50"))
    print(f"{a.requests} requests of {a.prompt_len} token ids, median of {a.repeats} runs")
    print(f"{'path':<16}{'TTFT p50 (ms)':>14}")
    print(f"{'LLM.generate':<16}{gen:>14.0f}\n{'server':<16}{srv:>14.0f}\n"
          f"{'server adds':<16}{srv - gen:>14.0f}")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    out = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": commit,
           "host": platform.processor() or platform.machine(), "settings": vars(a), **res,
           "generate_ttft_ms": gen, "server_ttft_ms": srv}
    path = Path(a.json or REPO / "benchmarks" / "results" / f"server_overhead_{a.label}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)
