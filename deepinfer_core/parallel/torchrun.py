"""launcher='torchrun': the data-parallel engine over torchrun's processes, on one node or several.

Every torchrun process runs the same command, e.g. `torchrun --nnodes 2 --node-rank R --nproc-per-node 8
--master-addr H --master-port P -m deepinfer_core.generate ... --data-parallel-size 16 --launcher torchrun`;
`LLM(...)` / `DataParallelLLM(...)` reads torchrun's variables (`torchrun_env`, WORLD_SIZE must equal
data_parallel_size) and then:

* global rank 0 is the front end, as with launcher='spawn' (tokenizer, request placement, generate, the
  server): it runs rank 0's engine in one spawned child (GPU LOCAL_RANK), waits for the other ranks to
  connect (`FrontEnd`) and returns to the caller;
* every other rank runs its engine in its own torchrun process (`run_rank`) until the front end stops it,
  then raises SystemExit(0): the code after `LLM(...)` runs on rank 0 only. A rank that fails exits 1.

Rendezvous: the ranks' process groups join torchrun's agent store (init_method env://; with
TORCHELASTIC_USE_AGENT_STORE=True the agent of node 0 hosts a TCPStore at MASTER_ADDR:MASTER_PORT). The
front end writes its listening address ("ip:port", ip: this host's address on the route to MASTER_ADDR)
under FRONTEND_KEY in that store; each rank reads it, connects (`multiprocessing.connection`, an HMAC
challenge with `TorchrunEnv.authkey`), says hello (rank, local rank, local world size, host, cores) and
gets its WorkerSpec back at once, so every rank runs the front end's resolved config (the checkpoint must
be at the same path on every node).

One duplex connection per remote rank carries commands (front end -> rank) and reports (rank -> front
end). On the rank a thread reads the commands into a queue, so `RankLoop` sees a spawned rank's queue
and the front end's sends never wait on the rank's engine loop; the connection ending before a
("stop",) means the front end is gone, and the rank exits at once. On the front end the connections
join the child's report pipe (`ReportReceiver.add`) and each remote rank stands in `_procs` as a
`RemoteRank` whose exitcode is CONNECTION_LOST once its connection ended, so `dead_ranks`, the failure
path and `close` treat it as a spawned rank (a remote rank that dies is seen as its connection ends).

Trust: the front end listens on every interface, and the connections carry pickles. A client must know
the key: DEEPINFER_DP_AUTHKEY when set (the same on every node), else one derived from
TORCHELASTIC_RUN_ID, MASTER_ADDR and MASTER_PORT, which anyone who can see the job's command line can
derive too: without DEEPINFER_DP_AUTHKEY the channel is as trusted as the cluster network. IPv4 only.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import AuthenticationError, Client, Connection, Listener
from typing import Any, NoReturn

from .. import envs
from .dp_messages import WorkerSpec

log = logging.getLogger("deepinfer.dp")

FRONTEND_KEY = "deepinfer/frontend"  # in torchrun's agent store, per restart attempt
CONNECTION_LOST = 256  # a RemoteRank's exitcode once its connection ended (no exit status is)
POLL_S = 0.1
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


@dataclass(frozen=True)
class TorchrunEnv:
    """This process's place in the torchrun job, as its variables describe it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    authkey: bytes = field(repr=False)

    @property
    def store_key(self) -> str:
        return f"{FRONTEND_KEY}/attempt_{self.restart_count}"


def torchrun_env(env: Mapping[str, str], data_parallel_size: int) -> TorchrunEnv:
    """torchrun's variables, checked (a ValueError names the variable and what is allowed)."""

    def text(name: str) -> str:
        raw = env.get(name, "").strip()
        if not raw:
            raise ValueError(
                f"launcher='torchrun' needs the environment variable {name}, which is not set; torchrun "
                f"sets {', '.join(TORCHRUN_VARS)}: run the command under torchrun, or use "
                "launcher='spawn'"
            )
        return raw

    def number(name: str, low: int, high: int | None, default: int | None = None) -> int:
        raw = env.get(name, "").strip() if default is not None else text(name)
        if not raw:
            return default
        value = int(raw) if raw.isdigit() else None
        if value is None or value < low or (high is not None and value > high):
            allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
            raise ValueError(f"environment variable {name}={raw!r}; allowed: {allowed}")
        return value

    world = number("WORLD_SIZE", 1, None)
    if world != data_parallel_size:
        raise ValueError(
            f"environment variable WORLD_SIZE={world} (torchrun's nodes x processes per node) disagrees "
            f"with data_parallel_size={data_parallel_size}; allowed: data_parallel_size={world} (one "
            f"rank per torchrun process), or a torchrun job of {data_parallel_size} processes"
        )
    local_world = number("LOCAL_WORLD_SIZE", 1, world)
    agent = text("TORCHELASTIC_USE_AGENT_STORE")
    if agent != "True":
        raise ValueError(
            f"environment variable TORCHELASTIC_USE_AGENT_STORE={agent!r}; allowed: 'True' (the ranks "
            "meet in the store torchrun's agent hosts at MASTER_ADDR:MASTER_PORT)"
        )
    addr, port = text("MASTER_ADDR"), number("MASTER_PORT", 1, 65535)
    secret = envs.get("DEEPINFER_DP_AUTHKEY", env)
    if secret is None:
        secret = "\0".join(("deepinfer-dp", env.get("TORCHELASTIC_RUN_ID", ""), addr, str(port)))
    return TorchrunEnv(
        rank=number("RANK", 0, world - 1),
        local_rank=number("LOCAL_RANK", 0, local_world - 1),
        world_size=world,
        local_world_size=local_world,
        master_addr=addr,
        master_port=port,
        restart_count=number("TORCHELASTIC_RESTART_COUNT", 0, None, default=0),
        authkey=hashlib.sha256(secret.encode()).digest(),
    )


def host_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _store(env: TorchrunEnv, timeout_s: float):
    """A client of torchrun's agent store."""
    from torch.distributed import TCPStore

    return TCPStore(env.master_addr, env.master_port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def route_address(host: str, port: int) -> str:
    """This host's IPv4 address on the route to host:port (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


class ConnSender:
    """The sends of one end of a rank's connection (the front end's commands, or the rank's reports):
    `put` pickles and writes now, under a lock. A connection that ended is no error here: the reading
    side sees it end (the front end then reports the rank, the rank exits)."""

    def __init__(self, conn: Connection):
        self._conn = conn
        self._lock = threading.Lock()

    def put(self, msg: Any) -> None:
        with self._lock:
            try:
                self._conn.send(msg)
            except OSError:
                pass

    def close(self) -> None:
        self._conn.close()

    def cancel_join_thread(self) -> None:
        """A spawned rank's queue has a feeder thread to let go of; a connection has none."""


class RemoteRank:
    """A rank in another torchrun process, where the front end keeps a spawned rank's Process: `exitcode`
    is None while its connection lasts, then CONNECTION_LOST; `kill` closes the connection (the rank then
    exits at once); the process itself is its node's torchrun agent's to reap."""

    def __init__(self, rank: int, conn: Connection, host: str):
        self.rank, self.conn, self.host = rank, conn, host
        self.exitcode: int | None = None

    def lost(self) -> None:
        if self.exitcode is None:
            self.exitcode = CONNECTION_LOST

    def kill(self) -> None:
        self.conn.close()
        self.lost()

    def join(self, timeout: float | None = None) -> None:
        """Nothing to wait for here (see the class docstring)."""


class FrontEnd:
    """Global rank 0's listener: publishes its address in torchrun's store and accepts (in a thread) one
    connection per other rank; `connect` hands each its WorkerSpec as it says hello."""

    def __init__(self, env: TorchrunEnv, timeout_s: float):
        self.env = env
        ip = route_address(env.master_addr, env.master_port)
        self._listener = Listener(("0.0.0.0", 0), authkey=env.authkey)
        self.address = f"{ip}:{self._listener.address[1]}"
        self._accepted: queue.Queue = queue.Queue()
        threading.Thread(
            target=self._accept, args=(env.world_size - 1,), name="deepinfer-dp-accept", daemon=True
        ).start()
        try:
            _store(env, timeout_s).set(env.store_key, self.address)
        except Exception as exc:  # DistStoreError, connection refused, ...
            self._listener.close()
            raise RuntimeError(
                f"DataParallelLLM: cannot reach torchrun's agent store at {env.master_addr}:"
                f"{env.master_port} (MASTER_ADDR, MASTER_PORT): {exc}"
            ) from exc

    def _accept(self, count: int) -> None:
        while count:
            try:
                conn = self._listener.accept()
            except AuthenticationError as exc:  # a stray client, or a rank with another DEEPINFER_DP_AUTHKEY
                log.warning("data parallel: a connection to the front end failed authentication: %s", exc)
                continue
            except OSError:  # closed
                return
            self._accepted.put(conn)
            count -= 1

    def connect(
        self, make_spec: Callable[[int, int, int], WorkerSpec], check_alive: Callable[[], None], timeout_s: float
    ) -> list[RemoteRank]:
        """Ranks 1 .. world - 1, in order, once all have connected; each gets make_spec(rank, local rank,
        threads) as soon as it says hello. `check_alive()` raises when a rank of this process died; ranks
        missing after `timeout_s` raise a RuntimeError naming them (the connected ones are then closed,
        and they exit)."""
        world, ranks = self.env.world_size, {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(ranks) < world - 1:
                check_alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(1, world) if r not in ranks]
                    raise RuntimeError(
                        f"DataParallelLLM: data-parallel ranks {missing} of {world} did not connect "
                        f"to the front end at {self.address} within {timeout_s:g} s (launcher="
                        "'torchrun': every rank runs the same command with the same "
                        "DEEPINFER_DP_AUTHKEY, if set)"
                    )
                try:
                    conn = self._accepted.get(timeout=min(POLL_S, left))
                except queue.Empty:
                    continue
                hello = _hello(conn, world, ranks)
                if hello is not None:
                    rank, local_rank, local_world, host, cores = hello
                    ranks[rank] = RemoteRank(rank, conn, host)
                    try:
                        conn.send(("spec", make_spec(rank, local_rank, max(1, cores // local_world))))
                    except OSError as exc:
                        raise RuntimeError(
                            f"DataParallelLLM: data-parallel rank {rank} of {world} (host {host}) connected, then "
                            f"its connection ended before it got its spec: {exc}"
                        ) from exc
        except BaseException:
            for remote in ranks.values():
                remote.kill()
            raise
        self._listener.close()
        log.info("data parallel: ranks 1-%d connected from %s", world - 1, sorted({r.host for r in ranks.values()}))
        return [ranks[r] for r in sorted(ranks)]


def _hello(conn: Connection, world: int, ranks: dict[int, RemoteRank]) -> tuple | None:
    """A new connection's hello, checked; a bad one is refused (the rank raises) and dropped."""
    try:
        msg = conn.recv() if conn.poll(5.0) else None
    except (EOFError, OSError):
        msg = None
    ok = isinstance(msg, tuple) and len(msg) == 6 and msg[0] == "hello"
    ok = ok and all(isinstance(msg[i], int) for i in (1, 2, 3, 5)) and msg[3] >= 1 and msg[5] >= 1
    why = None
    if not ok:
        why = f"expected ('hello', rank, local rank, local world size, host, cores), got {msg!r}"[:300]
    elif not 1 <= msg[1] < world or msg[1] in ranks:
        why = f"rank {msg[1]} is not one this front end waits for (1 .. {world - 1}, each once)"
    if why is None:
        return msg[1:]
    log.warning("data parallel: refused a connection to the front end: %s", why)
    try:
        conn.send(("refused", why))
    except OSError:
        pass
    conn.close()
    return None


def run_rank(env: TorchrunEnv, timeout_s: float) -> NoReturn:
    """Rank env.rank > 0: connect to the front end, run this rank's engine here until the front end stops
    it, then SystemExit(0). Failures before the engine starts raise; the engine's own exit at once
    (worker_main reports them to the front end, then os._exit(1))."""
    from .dp_worker import worker_main

    try:
        address = _store(env, timeout_s).get(env.store_key).decode()
    except Exception as exc:  # DistStoreError (timeout), connection refused, ...
        raise RuntimeError(
            f"data-parallel rank {env.rank}: no front end address under {env.store_key!r} in "
            f"torchrun's store at {env.master_addr}:{env.master_port} within {timeout_s:g} s (did "
            f"global rank 0 start?): {exc}"
        ) from exc
    host, _, port = address.rpartition(":")
    try:
        conn = Client((host, int(port)), authkey=env.authkey)
    except AuthenticationError as exc:
        raise RuntimeError(
            f"data-parallel rank {env.rank}: the front end at {address} refused this rank's key "
            "(set the same DEEPINFER_DP_AUTHKEY on every node, or on none)"
        ) from exc
    conn.send(("hello", env.rank, env.local_rank, env.local_world_size, socket.gethostname(), host_cores()))
    if not conn.poll(timeout_s):
        raise RuntimeError(
            f"data-parallel rank {env.rank}: no answer from the front end at {address} within {timeout_s:g} s"
        )
    kind, body = conn.recv()
    if kind != "spec":
        raise RuntimeError(f"data-parallel rank {env.rank}: the front end at {address} refused it: {body}")
    commands: queue.Queue = queue.Queue()
    threading.Thread(
        target=_read_commands, args=(conn, commands, env.rank), name="deepinfer-dp-commands", daemon=True
    ).start()
    worker_main(body, commands, ConnSender(conn))
    conn.close()
    raise SystemExit(0)


def _read_commands(conn: Connection, commands: queue.Queue, rank: int) -> None:
    """The rank's command reader: until ("stop",); an end before it means the front end is gone."""
    try:
        while True:
            cmd = conn.recv()
            commands.put(cmd)
            if cmd[0] == "stop":
                return
    except (EOFError, OSError):
        pass
    print(
        f"deepinfer: data-parallel rank {rank}: the front end's connection ended; exiting", file=sys.stderr, flush=True
    )
    os._exit(1)
