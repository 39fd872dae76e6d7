"""launcher='torchrun' (parallel/torchrun.py): the data-parallel engine over torchrun's processes.

Oracle: the same prompts through plain `LLM.generate` in this process; the greedy tokens must be identical
(float32, QAT off, batch-invariant GEMMs, as in test_dp_options.py). The torchrun jobs run as subprocesses
(`python -m torch.distributed.run`), CPU ranks over gloo on the tiny model, each with a timeout and killed
if it outlives it:

* one node, two processes: the generate CLI, the same command on both ranks (rank 1 prints nothing);
* two nodes simulated on this host (two torchrun agents of one process each, LOCAL_RANK 0 on both, so
  rank 1 reaches the front end over the cross-node path): a script's generate, then rank 1 exits in the
  middle of a generate (test hook), and rank 0's generate raises one RuntimeError naming rank 1 within
  seconds.

The variables torchrun sets, and the options, are checked without torchrun (fake environments).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from multiprocessing import Pipe
from pathlib import Path

import pytest
import torch

from deepinfer_core import LLM, SamplingParams, generate
from deepinfer_core.device_module import rank_devices
from deepinfer_core.engine_config import EngineConfig
from deepinfer_core.parallel import torchrun
from deepinfer_core.parallel.dp_config import check_device_count
from deepinfer_core.parallel.dp_engine import _exit_text
from deepinfer_core.parallel.dp_messages import WorkerSpec
from deepinfer_core.parallel.dp_worker import rank_device
from deepinfer_core.parallel.reports import ReportReceiver

REPO = Path(__file__).resolve().parents[2]
COMMON = dict(dtype="float32", simulate_qat=False, batch_invariant=True, num_speculative_tokens=0)
PROMPTS = ["To be, or not to be", "Friends, Romans, countrymen", "Now is the winter", "O Romeo"]
MAX_TOKENS = 6
JOB_TIMEOUT_S = 120
DP_FLAGS = ["--data-parallel-size", "2", "--enable-expert-parallel", "--launcher", "torchrun", "--device", "cpu"]
CLI_FLAGS = (f"--max-tokens {MAX_TOKENS} --temperature 0 --ignore-eos --no-progress --dtype float32 --no-simulate-qat "
             "--batch-invariant --num-speculative-tokens 0").split()

# Run by every torchrun process of the two-node jobs: argv = model, output file, what rank 0 does.
SCRIPT = f"""
import json, os, signal, sys, time
from deepinfer_core import LLM, SamplingParams

def main(model, out, mode):
    llm = LLM(model, data_parallel_size=2, enable_expert_parallel=True, launcher="torchrun", device="cpu",
              **{COMMON!r})
    # rank 0 only from here: rank 1 ran its engine inside LLM(...) and exited
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)       # the front end dies without a word
    params = SamplingParams(temperature=0.0, max_tokens={MAX_TOKENS}, ignore_eos=True)
    outputs = llm.generate({PROMPTS!r}, params)
    procs = [type(p).__name__ for p in llm._dp._procs]
    with open(out, "w") as f:
        json.dump({{"tokens": [o.outputs[0].token_ids for o in outputs], "procs": procs}}, f)
    llm._dp._exit_at = (1, 3)          # rank 1 exits at lockstep iteration 3 of the next generate
    t0 = time.monotonic()
    try:
        llm.generate({PROMPTS!r}, params)
    except RuntimeError as exc:
        print(f"generate failed after {{time.monotonic() - t0:.1f}} s: {{exc}}", file=sys.stderr, flush=True)
        sys.exit(3)
    sys.exit(4)

if __name__ == "__main__":
    main(*sys.argv[1:])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nodes: int, node_rank: int, per_node: int, port: int, *command: str) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(per_node),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        *command,
    ]
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_DP_AUTHKEY"}
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )  # its process group: killed whole on failure


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each job once it and every process it started closed their output
    (a rank left behind keeps it open); all are killed, process groups whole, if one outlives `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((proc.returncode, stdout, stderr))
    finally:
        if len(out) < len(procs):
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return out


@pytest.fixture(scope="module")
def oracle(tiny_ckpt_dir) -> list[list[int]]:
    llm = LLM(str(tiny_ckpt_dir), **COMMON)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_one_node_two_processes_cli_equals_one_process(oracle, tiny_ckpt_dir, tmp_path):
    out = tmp_path / "out.json"
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    job = _torchrun(
        1,
        0,
        2,
        _free_port(),
        "-m",
        "deepinfer_core.generate",
        "--model",
        str(tiny_ckpt_dir),
        *prompts,
        *CLI_FLAGS,
        *DP_FLAGS,
        "--output-json",
        str(out),
    )
    ((rc, stdout, stderr),) = _finish([job], JOB_TIMEOUT_S)
    assert rc == 0, stderr[-3000:]
    assert [o["outputs"][0]["token_ids"] for o in json.loads(out.read_text())] == oracle
    assert stdout.count("completion 0:") == len(PROMPTS)  # printed once: by rank 0, the front end


def test_two_nodes_equal_one_process_then_a_dead_remote_rank_fails_fast(oracle, tiny_ckpt_dir, tmp_path):
    script, out, port = tmp_path / "job.py", tmp_path / "out.json", _free_port()
    script.write_text(SCRIPT)
    node1 = _torchrun(2, 1, 1, port, str(script), str(tiny_ckpt_dir), str(tmp_path / "unused.json"), "generate")
    node0 = _torchrun(2, 0, 1, port, str(script), str(tiny_ckpt_dir), str(out), "generate")
    (rc0, _, err0), (rc1, _, err1) = _finish([node0, node1], JOB_TIMEOUT_S)
    got = json.loads(out.read_text())
    assert got["tokens"] == oracle
    assert got["procs"] == ["SpawnProcess", "RemoteRank"]  # rank 0's engine spawned here, rank 1 remote
    assert not (tmp_path / "unused.json").exists()  # rank 1 never ran the code after LLM(...)
    assert rc0 != 0 and "exitcode  : 3" in err0, err0[-3000:]  # the script's exit status, as its agent saw it
    line = next(x for x in err0.splitlines() if x.startswith("generate failed after"))
    assert "data-parallel rank 1 of 2 died (connection lost)" in line, line
    assert float(line.split()[3]) < 20, line
    assert rc1 != 0 and "exitcode  : 17" in err1, err1[-3000:]  # the test hook's exit, seen by its agent


def test_a_dead_front_end_ends_every_rank(tiny_ckpt_dir, tmp_path):
    """Rank 0's process SIGKILLed once the engine is up: its spawned engine (rank 0) and the other node's
    rank 1 exit at once, and both jobs end (`_finish` returns only when no process holds their output)."""
    script, port = tmp_path / "job.py", _free_port()
    script.write_text(SCRIPT)
    jobs = [
        _torchrun(2, node, 1, port, str(script), str(tiny_ckpt_dir), str(tmp_path / "out.json"), "kill")
        for node in (1, 0)
    ]
    t0 = time.monotonic()
    (rc1, _, err1), (rc0, _, err0) = _finish(jobs, JOB_TIMEOUT_S)
    assert time.monotonic() - t0 < 60
    assert rc0 != 0 and "exitcode  : -9" in err0, err0[-3000:]
    assert "data-parallel rank 0: the front end's process" in err0 and "died; exiting" in err0, err0[-3000:]
    assert rc1 != 0 and "data-parallel rank 1: the front end's connection ended; exiting" in err1, err1[-3000:]


# ---- without torchrun -----------------------------------------------------------------------------
def _env(**changes: str | None) -> dict[str, str]:
    env = {
        "RANK": "1",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "none",
    }
    env.update(changes)
    return {k: v for k, v in env.items() if v is not None}


def test_torchrun_env_reads_the_job():
    env = torchrun.torchrun_env(_env(), 2)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (1, 0, 2, 1)
    assert (env.master_addr, env.master_port, env.restart_count) == ("10.0.0.1", 29500, 0)
    assert env.store_key == "deepinfer/frontend/attempt_0"
    assert torchrun.torchrun_env(_env(TORCHELASTIC_RESTART_COUNT="2"), 2).store_key.endswith("attempt_2")
    # one key per job unless DEEPINFER_DP_AUTHKEY sets it; never shown
    assert env.authkey == torchrun.torchrun_env(_env(RANK="0"), 2).authkey
    assert env.authkey != torchrun.torchrun_env(_env(MASTER_PORT="29501"), 2).authkey
    secret = "s" * 20
    keyed = torchrun.torchrun_env(_env(DEEPINFER_DP_AUTHKEY=secret), 2)
    assert keyed.authkey != env.authkey and secret not in repr(keyed) and "authkey" not in repr(keyed)


@pytest.mark.parametrize(
    "changes, dp, match",
    [
        (
            dict(MASTER_ADDR=None),
            2,
            r"needs the environment variable MASTER_ADDR, which is not set; torchrun sets "
            r"RANK, .*run the command under torchrun, or use launcher='spawn'",
        ),
        (dict(RANK=None), 2, "needs the environment variable RANK"),
        (
            dict(WORLD_SIZE="4"),
            2,
            r"WORLD_SIZE=4 .* disagrees with data_parallel_size=2; allowed: "
            r"data_parallel_size=4",
        ),
        (dict(RANK="2"), 2, r"RANK='2'; allowed: an integer in \[0, 1\]"),
        (dict(LOCAL_RANK="x"), 2, r"LOCAL_RANK='x'; allowed: an integer in \[0, 0\]"),
        (dict(MASTER_PORT="70000"), 2, r"MASTER_PORT='70000'; allowed: an integer in \[1, 65535\]"),
        (dict(TORCHELASTIC_USE_AGENT_STORE="False"), 2, r"TORCHELASTIC_USE_AGENT_STORE='False'; allowed: 'True'"),
        (
            dict(DEEPINFER_DP_AUTHKEY="short"),
            2,
            r"DEEPINFER_DP_AUTHKEY \(set, 5 characters\) is invalid; allowed: a "
            r"string of 16 or more characters",
        ),
    ],
)
def test_torchrun_env_errors_name_the_variable(changes, dp, match):
    with pytest.raises(ValueError, match=match):
        torchrun.torchrun_env(_env(**changes), dp)


def test_launcher_option():
    assert EngineConfig.from_options().parallel.launcher == "spawn"
    with pytest.raises(
        ValueError,
        match=r"launcher='torchrun' with data_parallel_size=1: .* allowed: "
        r"data_parallel_size >= 2 .*, or launcher='spawn'",
    ):
        LLM(launcher="torchrun")
    with pytest.raises(ValueError, match=r"launcher='mpirun'; allowed: 'spawn', 'torchrun'"):
        EngineConfig.from_options(data_parallel_size=2, launcher="mpirun")
    assert "--launcher" in generate.build_parser().format_help()
    assert (
        generate.engine_options_from_args(generate.build_parser().parse_args(["--launcher", "torchrun"]))["launcher"]
        == "torchrun"
    )


def test_llm_outside_torchrun_is_refused_naming_the_variable(monkeypatch, tiny_ckpt_dir):
    for name in torchrun.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="launcher='torchrun' needs the environment variable"):
        LLM(str(tiny_ckpt_dir), data_parallel_size=2, launcher="torchrun", device="cpu")


def test_gpu_count_is_checked_per_node():
    with pytest.raises(
        ValueError,
        match=r"data_parallel_size=16 with device='cuda' and launcher='torchrun' needs 8 "
        r"GPUs on this node \(LOCAL_WORLD_SIZE=8, .* sees 4 .* allowed: torchrun "
        r"--nproc-per-node <= 4, or device='cpu'",
    ):
        check_device_count(16, rank_devices("cuda"), available=4, node_ranks=8)
    check_device_count(16, rank_devices("cuda"), available=8, node_ranks=8)  # 8 of the 16 ranks on this node: enough


def test_local_rank_picks_the_gpu_and_a_lost_connection_reads_as_such():
    config = EngineConfig.from_options(data_parallel_size=2, device="cuda")
    spec = WorkerSpec(5, 8, "env://", "/nowhere", config, False, 0, 60.0, 1, local_rank=1)
    assert rank_device(spec) == torch.device("cuda", 1)
    assert WorkerSpec(3, 8, "env://", "/nowhere", config, False, 0, 60.0, 1).local_rank == 3
    assert _exit_text(torchrun.CONNECTION_LOST) == "connection lost"


def test_a_remote_ranks_connection_ending_marks_it_dead():
    """ReportReceiver reads a remote rank's connection with the pipes; its end sets the proxy's exitcode."""
    import multiprocessing as mp

    front, rank = Pipe()
    receiver = ReportReceiver(mp.get_context("spawn"), 0)
    remote = torchrun.RemoteRank(1, front, "node1")
    receiver.add(front, remote.lost)
    torchrun.ConnSender(rank).put(("ready", 1, {}))
    assert receiver.get(timeout=5) == ("ready", 1, {}) and remote.exitcode is None
    rank.close()
    with pytest.raises(queue.Empty):
        receiver.get(timeout=1)
    assert remote.exitcode == torchrun.CONNECTION_LOST
    torchrun.ConnSender(front).put(("stop",))  # a closed connection is no error for the sender


def test_a_bad_hello_is_refused():
    front, rank = Pipe()
    rank.send(("hello", 3, 0, 1, "node1", 8))
    assert torchrun._hello(front, world=2, ranks={}) is None  # rank 3 of a world of 2
    assert rank.recv()[0] == "refused"
    front, rank = Pipe()
    rank.send(("hello", 1, 0, 0, "node1", 8))
    assert torchrun._hello(front, world=2, ranks={}) is None  # a node of 0 ranks
    assert "expected ('hello'" in rank.recv()[1]
    front, rank = Pipe()
    rank.send(("hello", 1, 0, 1, "node1", 8))
    assert torchrun._hello(front, world=2, ranks={}) == (1, 0, 1, "node1", 8)
