"""Host costs of long prompts and a large prefix cache, each beside the way it was done before:
validating a token-id prompt body (the server's one-pass JSON validation against `json.loads` and
pydantic's smart union), encoding an answer that carries the prompt's ids (pydantic-core against
FastAPI's `jsonable_encoder` and `json.dumps`), and evicting cached blocks (`PrefixIndex.evict`
against a scan and sort of every node). CPU only; prints a table and writes
benchmarks/results/host_costs_<label>.json.

    python benchmarks/host_costs.py [--prompt-len 6000] [--nodes 50000]
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import timeit
from pathlib import Path

from fastapi.encoders import jsonable_encoder
from pydantic import TypeAdapter
from pydantic_core import to_json

from deepinfer_core.cache.prefix_index import PrefixIndex, block_keys, root_key
from deepinfer_core.serve.protocol import CompletionRequest

REPO = Path(__file__).resolve().parents[1]
VOCAB = 129280


def ms(fn, number: int) -> float:
    return timeit.timeit(fn, number=number) / number * 1e3


def filled_index(nodes: int, rng: random.Random) -> PrefixIndex:
    """An index of `nodes` unreferenced blocks in chains of 10-60 (block size 4)."""
    index, root, n = PrefixIndex(), root_key("host_costs"), 0
    while n < nodes:
        parent = None
        for key in block_keys(root, [rng.randrange(1000) for _ in range(rng.randint(10, 60) * 4)],
                              4):
            parent = index.insert(parent, key, n)
            n += 1
    return index


def scan_and_sort(index: PrefixIndex, num: int) -> list:
    """How an eviction chose its blocks before: every unreferenced leaf, sorted by last use."""
    leaves = [n for n in index.nodes.values() if not n.children and n.refs == 0]
    return sorted(leaves, key=lambda n: n.last_use)[:num]


def measure(a: argparse.Namespace) -> list[dict]:
    rng = random.Random(0)
    ids = [rng.randrange(3, VOCAB) for _ in range(a.prompt_len)]
    body = json.dumps({"model": "m", "prompt": ids}).encode()
    smart = TypeAdapter(str | list[str] | list[int] | list[list[int]])
    answer = {"choices": [{"prompt_token_ids": ids, "token_ids": ids[:128], "text": "x"}]}
    index = filled_index(a.nodes, rng)
    n = a.number
    rows = [
        ("validate a token-id body", ms(lambda: CompletionRequest.model_validate_json(body), n),
         ms(lambda: smart.validate_python(json.loads(body)["prompt"]), n)),
        ("encode an answer with its ids", ms(lambda: to_json(answer), n),
         ms(lambda: json.dumps(jsonable_encoder(answer)), max(1, n // 10))),
        ("evict 8 of the cached blocks", ms(lambda: index.evict(8), n),
         ms(lambda: scan_and_sort(index, 8), max(1, n // 10))),
    ]
    return [{"operation": op, "now_ms": now, "before_ms": before} for op, now, before in rows]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=6000)
    p.add_argument("--nodes", type=int, default=50000, help="cached blocks in the prefix index")
    p.add_argument("--number", type=int, default=50, help="timed repetitions (fewer for the slow)")
    p.add_argument("--label", default=platform.machine())
    p.add_argument("--json", default=None,
                   help="result path (default: benchmarks/results/host_costs_<label>.json)")
    a = p.parse_args(argv)
    rows = measure(a)
    print(f"prompt of {a.prompt_len} token ids, {a.nodes} cached blocks")
    print(f"{'operation':<32}{'now (ms)':>10}{'before (ms)':>13}")
    for r in rows:
        print(f"{r['operation']:<32}{r['now_ms']:>10.3f}{r['before_ms']:>13.3f}")
    path = Path(a.json or REPO / "benchmarks" / "results" / f"host_costs_{a.label}.json")
    path.write_text(json.dumps({"settings": vars(a), "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
