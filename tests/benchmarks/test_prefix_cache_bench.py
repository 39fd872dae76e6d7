"""benchmarks/prefix_cache.py on the CPU, CI-sized: the agreement bookkeeping on synthetic outputs
(a difference in batch-invariant mode raises, otherwise it is reported), the per-call stats and
the off / on summary on synthetic rows (prefix_cache_report.py), and one end-to-end run of
main() at the smallest --ci size (a tiny checkpoint, 2 conversations x 2 turns, batch-invariant,
the no-shared workload too) whose JSON must hold every figure, a hit on turn 2 and identical greedy
outputs with caching on and off; and the same through the OpenAI server (`--server`, one
conversation). Nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import prefix_cache as PC
import prefix_cache_report as PR
import prefix_cache_workload as PW

SMALLEST = ["--ci", "--conversations", "2", "--turns", "2", "--history", "200,300",
            "--output-len", "4", "--user-len", "16", "--warmup-output-len", "1"]


def _pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_agreement_compares_only_conversations_that_still_agree():
    """Conversation 1 differs on turn 1: its later turns resend another history, so turn 2
    compares conversation 0 only; the no-shared workload compares every request every turn."""
    off = [[[1, 2], [3, 4]], [[5], [6]]]
    on = [[[1, 2], [3, 9]], [[5], [7]]]
    ag = PR.agreement({("shared", False): off, ("shared", True): on,
                       ("no_shared", False): off, ("no_shared", True): on}, 2)
    sh, ns = ag["shared"], ag["no_shared"]
    assert sh["turns"] == [{"turn": 1, "compared": 2, "identical": 1},
                           {"turn": 2, "compared": 1, "identical": 1}]
    assert ns["turns"][1] == {"turn": 2, "compared": 2, "identical": 1}
    assert not sh["identical"] and sh["first_difference_turn"] == 1
    PR.check_agreement(ag, False, "x.json")          # not batch-invariant: reported only
    with pytest.raises(AssertionError, match="batch-invariant"):
        PR.check_agreement(ag, True, "x.json")
    same = PR.agreement({("shared", False): off, ("shared", True): off}, 2)
    assert same["shared"]["identical"] and "no_shared" not in same
    PR.check_agreement(same, True, "x.json")


def test_stats_delta_and_summary_on_synthetic_rows():
    before = {"queries": 2, "hits": 1, "query_tokens": 500, "hit_tokens": 128,
              "cut_short": {"no_checkpoint": 1}}
    after = {"queries": 4, "hits": 3, "query_tokens": 1000, "hit_tokens": 512,
             "cut_short": {"no_checkpoint": 1, "checkpoint_slots_full": 2}}
    d = PR.stats_delta(before, after)
    assert (d["queries"], d["hits"], d["hit_tokens"]) == (2, 2, 384)
    assert d["cut_short"] == {"checkpoint_slots_full": 2} and d["hit_rate"] == pytest.approx(0.768)
    assert PR.stats_delta(None, after) is None

    def row(turn, elapsed, cached=None, best=None):
        return {"turn": turn, "status": "ok", "elapsed_s": elapsed, "output_tokens": 10,
                "prompt_tokens": 90, "ttft_ms": {"p50": elapsed * 100, "p99": elapsed * 200},
                "output_tok_s": 10 / elapsed, "total_tok_s": 100 / elapsed,
                "cached_tokens": cached, "best_cached_tokens": best}
    runs = {"shared": {"off": {"rows": [row(1, 2.0), row(2, 2.0)]},
                       "on": {"rows": [row(1, 2.0, 0, 0), row(2, 1.0, 64, 128)]}}}
    cmp = PR.compare_rows(runs["shared"], 3)
    assert cmp[1]["ttft_ms_p50_on_over_off"] == pytest.approx(0.5) and cmp[2]["status_on"] == "not run"
    s = PR.summary(runs, 3)["shared"]
    assert s["turns"] == 2 and s["off_over_on_elapsed"] == pytest.approx(4 / 3)
    assert s["turns_2_on_hit_of_best"] == pytest.approx(0.5) and s["on"]["total_tok_s"] == 200 / 3


def test_history_pairs_and_presets():
    assert PW.int_pair("2048,8192") == (2048, 8192) and PW.int_pair("300") == (300, 300)
    with pytest.raises(argparse.ArgumentTypeError):
        PW.int_pair("9,3")
    a = PW.resolve(["--ci", "--device", "cpu"])
    assert (a.conversations, a.turns, a.history, a.output_len) == (4, 3, (200, 400), 16)
    assert a.max_num_seqs == 4 and a.max_model_len == 640 and a.dtype == "float32"
    a = PW.resolve(["--device", "cpu", "--turns", "2"])
    assert (a.conversations, a.turns, a.history) == (64, 2, (2048, 8192))
    with pytest.raises(SystemExit):
        PW.resolve(["--ci", "--tiny"])


def test_main_at_the_smallest_ci_size(tmp_path, capsys):
    path = tmp_path / "pc.json"
    r = PC.main([*SMALLEST, "--batch-invariant", "--no-shared", "--json", str(path)])
    out = json.loads(path.read_text())
    assert r["json_path"] == str(path)
    for k in ("schema", "complete", "created", "device", "device_name", "commit", "versions",
              "command", "settings", "model", "engine", "startup_s", "block_size",
              "num_cache_blocks", "batch_invariant", "turns", "no_shared", "summary",
              "agreement", "runs", "definitions", "elapsed_s"):
        assert k in out, k
    assert out["complete"] and out["device"] == "cpu" and out["batch_invariant"] is True
    assert out["command"][0] == "benchmarks/prefix_cache.py" and out["block_size"] == 128
    assert out["model"]["config"]["compress_ratios"] == [0, 0, 4, 128]
    turns = out["turns"]
    assert [t["turn"] for t in turns] == [1, 2]
    for t in turns:
        assert t["status_off"] == "ok" and t["status_on"] == "ok", t
        for k in ("ttft_ms_p50_off", "ttft_ms_p50_on", "ttft_ms_p99_off", "ttft_ms_p99_on",
                  "ttft_ms_p50_on_over_off", "output_tok_s_off", "output_tok_s_on",
                  "total_tok_s_off", "total_tok_s_on"):
            assert _pos(t[k]), (k, t)
        assert t["ttft_ms_p50_on"] <= t["ttft_ms_p99_on"]
    assert turns[0]["hit_rate"] == 0 and turns[0]["best_hit_rate"] == 0
    t2 = turns[1]
    assert t2["hit_rate"] > 0 and t2["requests_hit"] == 2
    assert 0 < t2["hit_rate"] <= t2["best_hit_rate"] < 1 and 0 < t2["hit_of_best"] <= 1
    on = out["runs"]["shared"]["on"]["rows"]
    assert on[1]["prefix_stats"]["hits"] == 2 and on[1]["cached_tokens"] == t2["cached_tokens"]
    off = out["runs"]["shared"]["off"]["rows"]
    assert off[1]["cached_tokens"] == 0 and off[1]["prefix_stats"] is None
    assert all(t["hit_rate"] == 0 and t["status_on"] == "ok" for t in out["no_shared"])
    assert out["agreement"]["shared"]["identical"] and out["agreement"]["no_shared"]["identical"]
    s = out["summary"]["shared"]
    assert s["turns"] == 2 and _pos(s["off_over_on_elapsed"]) and s["turns_2_on_hit_of_best"] > 0
    printed = capsys.readouterr().out
    assert "TTFT p50 off" in printed and "of best" in printed and "-- no-shared" in printed


def test_server_at_the_smallest_ci_size(tmp_path, capsys):
    """--server: each turn a streamed /v1/completions request to a launched server; the
    returned ids (return_token_ids) make the next turn's history, which hits the cache, and every
    request got its output_len ids (a short one would make the row's status a warning)."""
    path = tmp_path / "pcs.json"
    PC.main([*SMALLEST, "--conversations", "1", "--batch-invariant", "--server",
             "--json", str(path)])
    out = json.loads(path.read_text())
    assert out["through"] == "server" and out["label"] == "ci_server" and out["complete"]
    assert "client" in out["definitions"]["ttft_ms"]
    turns = out["turns"]
    assert [(t["status_off"], t["status_on"]) for t in turns] == [("ok", "ok")] * 2
    assert all(_pos(t["ttft_ms_p50_off"]) and _pos(t["total_tok_s_on"]) for t in turns)
    assert turns[0]["hit_rate"] == 0 and turns[1]["requests_hit"] == 1
    assert 0 < turns[1]["hit_rate"] <= turns[1]["best_hit_rate"] and turns[1]["hit_of_best"] == 1
    on = out["runs"]["shared"]["on"]["rows"][1]
    assert on["prefix_stats"]["hit_tokens"] == on["cached_tokens"] > 0
    assert out["agreement"]["shared"]["identical"]
    assert "through the OpenAI server" in capsys.readouterr().out
