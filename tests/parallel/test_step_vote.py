"""The per-step agreement of expert-parallel ranks whose decode steps replay CUDA graphs
(`enable_ep_cuda_graphs`; step_vote.py): the vote itself over gloo processes, and how a rank's runner
follows it (the engine step's forward, or an iteration without one). The graphs themselves need GPUs
(`tests/parallel/test_dp_cuda.py`); here a stand-in records what the runner asked of them."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepinfer_core.parallel import ep_moe
from deepinfer_core.parallel.step_vote import StepVote
from deepinfer_core.runner.model_runner import ModelRunner

TIMEOUT_S = 60.0
# per round, each rank's (bucket or None, has_forward), and what every rank must get back
ROUNDS = [
    ([(4, True), (1, True), (None, False)], 4),           # graph: the largest bucket, the idle rank joins
    ([(4, True), (None, True), (None, False)], None),     # one rank must run eagerly: everyone does
    ([(None, False)] * 3, 0),                             # nobody has a forward: nobody exchanges
    ([(None, False), (None, False), (2, True)], 2),
]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from deepinfer_core.parallel.groups import ParallelLayout, destroy_process_groups, init_process_groups
    groups = init_process_groups(ParallelLayout.from_env(expert_parallel=True), backend="gloo", timeout_s=TIMEOUT_S,
                                 graph_ep=True)
    vote = StepVote(groups.cpu, rank)
    got = [vote(*votes[rank]) for votes, _ in ROUNDS]
    # the graphs' EP communicator: the same ranks, another group than the eager exchanges'
    graph_group = (groups.ep_graph is not groups.ep, torch.distributed.get_world_size(groups.ep_graph))
    torch.save({"got": got, "votes": vote.votes, "graph_steps": vote.graph_steps, "graph_group": graph_group},
               Path(out_dir) / f"rank{rank}.pt")
    destroy_process_groups(groups)


def test_ranks_agree_over_gloo(tmp_path, run_ranks):
    results, codes = run_ranks(_worker, 3, tmp_path, 45.0)
    assert codes == [0, 0, 0]
    want = [agreed for _, agreed in ROUNDS]
    for res in results:
        assert res["got"] == want
        assert res["votes"] == len(ROUNDS) and res["graph_steps"] == 2
        assert res["graph_group"] == (True, 3)


def test_world_of_one_and_bad_buckets():
    vote = StepVote(None, 0)
    assert (vote(3, True), vote(None, True), vote(None, False)) == (3, None, 0)
    with pytest.raises(ValueError, match=r"bucket=-2: allowed: None \(eager\) or a bucket size >= 1"):
        vote(-2, True)


class FakeGraphs:
    """Records the runner's graph calls; `captured` buckets are what `bucket_for` knows."""

    def __init__(self, captured=(1, 2, 4, 8)):
        self.captured, self.calls = captured, []

    def fits_step(self, num_seqs: int, num_tokens: int, num_logit_rows: int) -> bool:
        return num_tokens == num_seqs == num_logit_rows

    def bucket_for(self, num_seqs: int, q: int = 1):
        return next((b for b in self.captured if b >= num_seqs), None)

    def run_step(self, ids, positions, slots, q=1, size=None):
        self.calls.append(("graph", len(slots), size))
        return torch.zeros(len(slots), 3)


def _runner(agreed):
    votes = []

    def step_vote(bucket, has_forward):
        votes.append((bucket, has_forward))
        return agreed

    runner = SimpleNamespace(graphs=FakeGraphs(), step_vote=step_vote, model=None, dtype=torch.float32,
                             _apply_updates=lambda updates: None, _live_rows=torch.tensor(-1))
    runner._forward_batch = lambda batch: "fb"
    runner.model = lambda fb: (runner.graphs.calls.append(("eager", fb)), SimpleNamespace(logits=torch.ones(1)))[1]
    return runner, votes


def _batch(n: int, tokens: int | None = None):
    return SimpleNamespace(updates=None, slots=list(range(n)), ids=[0] * (tokens or n), logit_rows=list(range(n)),
                           starts=[0] * n)


def test_execute_follows_the_vote():
    runner, votes = _runner(8)                 # another rank's decode needs bucket 8
    ModelRunner.execute(runner, _batch(3))
    assert votes == [(4, True)] and runner.graphs.calls == [("graph", 3, 8)]
    assert runner._live_rows.item() == 3          # the bucket's other 5 rows are padding, routed nowhere
    runner, votes = _runner(None)              # another rank prefills: eager here too
    ModelRunner.execute(runner, _batch(3))
    assert votes == [(4, True)] and runner.graphs.calls == [("eager", "fb")]
    runner, votes = _runner(None)              # a prefill step here votes eager
    ModelRunner.execute(runner, _batch(2, tokens=9))
    assert votes == [(None, True)] and runner.graphs.calls == [("eager", "fb")]


def test_idle_iteration_follows_the_vote(monkeypatch):
    idle = []
    monkeypatch.setattr(ep_moe, "idle_forward", lambda model, dtype: idle.append(dtype))
    for agreed, ran, graph_calls, eager_idle in ((None, True, [], 1), (0, False, [], 0),
                                                 (4, True, [("graph", 0, 4)], 0)):
        idle.clear()
        runner, votes = _runner(agreed)
        assert ModelRunner.idle_step(runner) is ran
        assert votes == [(None, False)] and runner.graphs.calls == graph_calls and len(idle) == eager_idle
        assert runner._live_rows.item() == (0 if graph_calls else -1)      # a replay of padding rows only
    runner, _ = _runner(None)
    runner.step_vote = None                    # EP without graphs: always the eager placeholder pass
    idle.clear()
    assert ModelRunner.idle_step(runner) is True and len(idle) == 1
