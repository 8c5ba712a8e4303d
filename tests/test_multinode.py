"""Two nodes on one machine: two torchrun node agents (2 ranks each, c10d
rendezvous on loopback) train exactly like one node of 4 ranks, their checkpoints
resume on one node, and killing one agent ends the other with a clear error.

CPU, gloo. Every wait is bounded, and every process a test started is killed in
its `finally`, found by the test's own output directory in its command line.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labml_zero.launch import free_port
from tests.distributed import skip_job_without_gpus
from tests.test_finetune import run_dirs, tracked

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
# The tiny model, 4 ranks × 2 sequences of 32 tokens, a checkpoint at step 2.
JOB = ["--batch-size", "2", "--seq-len", "32", "--valid-every", "2",
       "--sample-tokens", "0"]
# An agent that lost its peer ends within this (measured: a few seconds).
AGENT_GONE_S = 60


def environment(tmp: Path) -> dict:
    # torchrun keeps a log directory per run in the temporary directory
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "TMPDIR": str(tmp)}


def job_args(tmp: Path, *args: str) -> list[str]:
    return ["-m", "labml_zero.finetune_neox", *JOB, "--out", str(tmp / "out"),
            "--log-dir", str(tmp / "logs"), *args]


def one_node(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    skip_job_without_gpus(4)
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, *job_args(tmp, "--world-size", "4",
                                                     *args)],
                          cwd=tmp, env=environment(tmp), capture_output=True,
                          text=True, timeout=300)


def start_nodes(tmp: Path, *args: str) -> list[subprocess.Popen]:
    """Two node agents, each in a session of its own (so each can be killed)."""
    skip_job_without_gpus(4)
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint = f"127.0.0.1:{port}"

    def agent(node: int) -> subprocess.Popen:
        return subprocess.Popen(
            [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend",
             "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "test",
             "--node-rank", str(node), *job_args(tmp, *args)],
            cwd=tmp, env=environment(tmp), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True)

    # Both agents are on this host, so either could host the rendezvous store;
    # node 1 starts once node 0 listens, so node 0 hosts it, as the head node of
    # a cluster would, and killing node 1 never takes the store with it.
    first = agent(0)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert first.poll() is None and time.monotonic() < deadline, \
                "node 0 did not start its rendezvous store"
            time.sleep(0.1)
    return [first, agent(1)]


def processes_of(tmp: Path) -> list[int]:
    """Every live process whose command line names this test's directory."""
    mark = str(tmp / "out").encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if mark in (entry / "cmdline").read_bytes() and (
                    entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def kill_all(tmp: Path) -> None:
    for pid in processes_of(tmp):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(nodes: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each agent's stderr, once it exits; the test fails after `timeout`."""
    deadline = time.monotonic() + timeout
    return [node.communicate(timeout=max(1.0, deadline - time.monotonic()))[1]
            for node in nodes]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("single")
    result = one_node(tmp, "--steps", "4", "--checkpoint-every", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("two_nodes")
    try:
        nodes = start_nodes(tmp, "--steps", "4", "--checkpoint-every", "2")
        errors = finish(nodes, 300)
        for node, stderr in zip(nodes, errors):
            assert node.returncode == 0, stderr[-3000:]
    finally:
        kill_all(tmp)
    return tmp


def losses(tmp: Path) -> dict[str, dict[int, float]]:
    run = tracked(run_dirs(tmp)[0])
    return {name: run[name] for name in ("loss.train", "loss.valid")}


def test_two_nodes_train_like_one(single: Path, two_nodes: Path):
    assert sorted(run_dirs(two_nodes)) == [0, 1, 2, 3]
    ours, theirs = losses(two_nodes), losses(single)
    assert sorted(ours["loss.train"]) == [1, 2, 3, 4]
    assert ours == theirs  # bit for bit: the same floats


def test_two_node_checkpoint_resumes_on_one_node(single: Path, two_nodes: Path,
                                                 tmp_path: Path):
    checkpoint = two_nodes / "out" / "checkpoints" / "step-000002"
    result = one_node(tmp_path, "--steps", "4", "--resume", str(checkpoint))
    assert result.returncode == 0, result.stderr[-3000:]
    resumed, full = losses(tmp_path), losses(single)
    assert sorted(resumed["loss.train"]) == [3, 4]
    for step in (3, 4):
        assert resumed["loss.train"][step] == full["loss.train"][step]
    assert resumed["loss.valid"][4] == full["loss.valid"][4]


def test_two_nodes_with_hybrid_sharding_train_like_one(tmp_path: Path):
    """Issue #16: shards inside each node (`--shard-group-size 2`), replicas
    across the two nodes, trains bit for bit like the same run on one node."""
    hybrid = ["--steps", "2", "--shard-group-size", "2"]
    single = one_node(tmp_path / "single", *hybrid)
    assert single.returncode == 0, single.stderr[-3000:]
    tmp = tmp_path / "two_nodes"
    try:
        nodes = start_nodes(tmp, *hybrid)
        for node, stderr in zip(nodes, finish(nodes, 300)):
            assert node.returncode == 0, stderr[-3000:]
    finally:
        kill_all(tmp)
    ours, theirs = losses(tmp), losses(tmp_path / "single")
    assert sorted(ours["loss.train"]) == [1, 2]
    assert ours == theirs  # bit for bit: the same floats


def test_killed_node_agent_ends_the_other(tmp_path: Path):
    try:
        nodes = start_nodes(tmp_path, "--steps", "100000", "--valid-every",
                            "100000")
        deadline = time.monotonic() + 180
        # training has begun once rank 0 has logged a training loss
        while not any("loss.train" in p.read_text()
                      for p in tmp_path.glob("logs/*/*.0/log.jsonl")):
            assert time.monotonic() < deadline, "the job did not start training"
            assert all(node.poll() is None for node in nodes)
            time.sleep(0.2)
        nodes[1].kill()  # the agent only: its ranks die with it
        killed = time.monotonic()
        (stderr,) = finish(nodes[:1], AGENT_GONE_S)
        took = time.monotonic() - killed
        print(f"agent 0 ended {took:.1f} s after agent 1 was killed")
        assert nodes[0].returncode != 0
        assert took < AGENT_GONE_S
        assert "stopped: another rank failed or is gone" in stderr, stderr[-3000:]
        assert "ChildFailedError" in stderr
        deadline = time.monotonic() + 10
        while processes_of(tmp_path):  # the killed agent's ranks too
            assert time.monotonic() < deadline, processes_of(tmp_path)
            time.sleep(0.1)
    finally:
        kill_all(tmp_path)
