"""Every guarantee of one node, across simulated nodes (tests/nodes.py): separate hosts' PID, mount and
network namespaces on one machine, a shared save directory, torchrun with a static rendezvous on node 0.

The reference is an uninterrupted run of the same world size on one host: the job's losses do not
depend on how its ranks are spread over nodes, so every multi-node run must match it bit for bit.
Needs root (CI runs as root); without it every test here skips, saying why.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import nodes
import pytest
from harness import (
    assert_losses_close,
    committed_steps,
    events,
    last_iteration,
    losses,
    run,
    script_cmd,
    starts,
    train_cmd,
    wait_for_iteration,
    wait_for_snapshots,
    wait_no_agent,
)

WHY_NOT = nodes.unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

N = 24
MEM = 2
COMMON = ["--iters", str(N), "--mem-interval", str(MEM), "--storage-interval", "10", "--max-ckpt", "2"]
TIMEOUT = 240


@pytest.fixture(scope="module", autouse=True)
def no_namespace_left_behind():
    for ns in nodes.our_namespaces():        # an earlier run's, killed before its cleanup ran
        if not Path(f"/proc/{ns.split('-')[1]}").exists():
            nodes.remove_namespace(ns)
    yield
    left = nodes.our_namespaces()
    assert not left, f"network namespaces left behind: {left}"


@pytest.fixture
def cluster(tmp_path):
    made: List[nodes.Cluster] = []

    def make(n: int) -> nodes.Cluster:
        made.append(nodes.Cluster(n, tmp_path))
        return made[-1]
    try:
        yield make
    finally:
        for c in made:
            c.close()


_references: Dict[tuple, Dict[int, Dict[int, str]]] = {}


def reference(tmp_path_factory, world: int, common: tuple = tuple(COMMON)) -> Dict[int, Dict[int, str]]:
    """rank -> iteration -> loss of an uninterrupted run of ``world`` ranks on one host (cached)."""
    key = (world, common)
    if key not in _references:
        d = tmp_path_factory.mktemp(f"reference{world}")
        run(train_cmd(d / "ckpt", world, *common, "--loss-file", str(d / "loss")), timeout=TIMEOUT)
        wait_no_agent(d / "ckpt")
        _references[key] = {r: losses(d / "loss", r) for r in range(world)}
    return _references[key]


def assert_losses(loss: Path, ref: Dict[int, Dict[int, str]], n: int = N) -> None:
    for rank, want in ref.items():
        got = losses(loss, rank)
        assert sorted(got) == list(range(1, n + 1)), f"rank {rank}: iterations {sorted(got)}"
        diff = [i for i in got if got[i] != want[i]]
        assert not diff, f"rank {rank}: losses differ from the uninterrupted run at iterations {diff}"


def said(runs) -> str:
    return "\n".join(f"--- node {r.node.index}:\n{r.output()[-2500:]}" for r in runs)


def hosts_of(log: Path, event: str) -> Dict[int, str]:
    """rank -> the host that logged ``event`` for it."""
    return {e["rank"]: e["host"] for e in events(log) if e["event"] == event and "rank" in e}


def newest_replica(log: Path, host: str):
    """The newest step ``host`` has replicated to a peer (None when none yet)."""
    sent = [e["step"] for e in events(log) if e["event"] == "replica_sent" and e["host"] == host]
    return max(sent) if sent else None


def ranks_by_node(nnodes: int, nproc: int) -> Dict[int, str]:
    return {node * nproc + local: f"node{node}" for node in range(nnodes) for local in range(nproc)}


# ---- SIGTERM to one node -------------------------------------------------------------------------------

def sigterm_one_node(tmp_path: Path, cluster, tmp_path_factory, nnodes: int, nproc: int, at: int) -> None:
    """The usual maintenance event: every process of the last node (its trainers and its agent; torchrun
    is spared, see NodeRun.signal) gets SIGTERM. All ranks on all nodes agree on a step, it commits (every rank's shard), no iteration is lost,
    every node exits 0, and the resumed run's losses equal the uninterrupted run's."""
    world = nnodes * nproc
    ref = reference(tmp_path_factory, world)
    c = cluster(nnodes)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    args = (*COMMON, "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", "0.05", "--idle-timeout", "5")
    runs = c.launch(ckpt, nproc, *args)
    victim = runs[-1]
    wait_for_iteration(loss, at, victim.proc, TIMEOUT, rank=world - 1)
    signalled = victim.signal(signal.SIGTERM, launcher=False)
    rcs = c.wait(runs, TIMEOUT)
    what = f"SIGTERM to the {len(signalled)} processes of node {nnodes - 1} after iteration {at}\n{said(runs)}"
    assert rcs == [0] * nnodes, f"exit statuses {rcs}: {what}"
    saves = [e for e in events(log) if e["event"] == "sigterm_save"]
    assert sorted(e["rank"] for e in saves) == list(range(world)), f"{saves}\n{what}"
    assert {e["rank"]: e["host"] for e in saves} == ranks_by_node(nnodes, nproc), f"ranks on the wrong nodes: {saves}"
    agreed = saves[0]["step"]
    assert all(e["step"] == agreed and e["exit"] for e in saves), f"ranks saved different steps: {saves}"
    assert committed_steps(ckpt)[-1] == agreed, f"step {agreed} not committed: {committed_steps(ckpt)}\n{what}"
    commits = [e for e in events(log) if e["event"] == "commit" and e["step"] == agreed]
    assert [e["host"] for e in commits] == ["node0"], f"the coordinator is node 0's agent: {commits}"
    reached = [last_iteration(loss, r) for r in range(world)]
    assert reached == [agreed] * world, f"trained to {reached}, saved {agreed}: iterations lost\n{what}"
    out0 = runs[0].output()
    assert out0.count(f"easyckpt: SIGTERM: saving step {agreed} on all {world} ranks\n") == 1, out0[-3000:]
    # the job restarted on fresh nodes (their memory is empty): from storage, to the end
    again = c.launch(ckpt, nproc, *args, tag="resumed")
    assert c.wait(again, TIMEOUT) == [0] * nnodes, said(again)
    assert {starts(loss, r)[-1] for r in range(world)} == {agreed}
    loads = [e for e in events(log) if e["event"] == "load" and e["step"] == agreed]
    assert sorted(e["rank"] for e in loads) == list(range(world)) and {e["source"] for e in loads} == {"storage"}
    assert_losses(loss, ref)


def test_sigterm_to_one_node_saves_the_agreed_step_on_every_node_and_loses_nothing(tmp_path, cluster,
                                                                                    tmp_path_factory):
    sigterm_one_node(tmp_path, cluster, tmp_path_factory, 2, 1, at=7)


@pytest.mark.slow
@pytest.mark.parametrize("nnodes,nproc", [(2, 2), (4, 1)])
def test_sigterm_to_one_node_of_several(tmp_path, cluster, tmp_path_factory, nnodes, nproc):
    sigterm_one_node(tmp_path, cluster, tmp_path_factory, nnodes, nproc, at=9)


# ---- commit -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_step_commits_only_once_every_nodes_shards_are_durable(tmp_path, cluster, tmp_path_factory):
    """Node 1's agent writes slowly (1.5 s per file): node 0's coordinator commits each step only after
    node 1's shard of it is durable, and the manifest names every rank's files."""
    ref = reference(tmp_path_factory, 4)
    c = cluster(2)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    runs = c.launch(ckpt, 2, *COMMON, "--loss-file", str(loss), "--log-file", str(log), "--idle-timeout", "5",
                    node_env={1: {"EASYCKPT_FAULTS": "agent.persist_file=sleep:1.5"}})
    assert c.wait(runs, TIMEOUT) == [0, 0], said(runs)
    evs = events(log)
    commits = [e for e in evs if e["event"] == "commit"]
    assert [e["step"] for e in commits] == [10, 20, N], commits
    for commit in commits:
        step = commit["step"]
        persisted = {e["rank"]: e for e in evs if e["event"] == "persist" and e["step"] == step}
        assert sorted(persisted) == [0, 1, 2, 3], f"step {step}: shards of ranks {sorted(persisted)}"
        assert commit["host"] == "node0" and {persisted[r]["host"] for r in (2, 3)} == {"node1"}
        slowest = max(e["time"] for e in persisted.values())
        assert commit["time"] >= slowest, f"step {step} committed before node 1's shard was durable"
        assert persisted[2]["seconds"] >= 1.5, "the slow write did not happen on node 1"
    for step in committed_steps(ckpt):
        man = json.loads((ckpt / f"step_{step:08d}" / "easyckpt_manifest.json").read_text())
        assert man["world_size"] == 4
        # every rank's own shard (its RNG state), node 1's included, besides rank 0's model and optimizer
        assert {f"rank_{r:05d}.safetensors" for r in range(4)} <= set(man["files"]), sorted(man["files"])
    assert_losses(loss, ref)


# ---- the grace deadline ---------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("signalled", ["every trainer", "the stuck node"])
def test_the_fallback_step_is_complete_on_every_node_when_one_nodes_trainers_are_stuck(tmp_path, cluster,
                                                                                       signalled):
    """Node 1's iteration 9 takes 12 s (its rank is stuck; node 0's waits in the next collective). SIGTERM
    with a 3 s grace deadline — to every trainer (the job is cancelled), or to every process of the stuck
    node only (it is drained): each node's agent persists its ranks' newest snapshot (step 8) and node 0
    commits it, every rank's shard, before the deadline. Cancelled, the trainers then agree on a step and
    save it; drained, the node is gone at its deadline and the job resumes from step 8."""
    c = cluster(2)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    args = ("--iters", "20", "--mem-interval", "2", "--storage-interval", "10", "--loss-file", str(loss),
            "--log-file", str(log), "--grace", "3", "--idle-timeout", "5")
    # drained: node 0's commit of the fallback takes 1 s, past node 1's deadline, when its agent leaves —
    # and must leave the step's staging dir (node 0's shard is in it) to the coordinator
    slow_commit = {0: {"EASYCKPT_FAULTS": "agent.before_rename=sleep:1"}} if signalled == "the stuck node" else {}
    runs = c.launch(ckpt, 1, *args, node_args={1: ["--slow-step", "9:12"]}, node_env=slow_commit)
    wait_for_iteration(loss, 8, runs[1].proc, TIMEOUT, rank=1)
    time.sleep(0.5)                       # node 1 is inside iteration 9 now
    if signalled == "every trainer":
        for r in runs:
            for pid in r.trainers().values():
                os.kill(pid, signal.SIGTERM)
    else:
        runs[1].signal(signal.SIGTERM, launcher=False)
    signalled_at = time.time()
    deadline = time.monotonic() + 10
    while 8 not in committed_steps(ckpt):
        assert time.monotonic() < deadline, f"no fallback checkpoint within 10 s: {events(log)[-6:]}\n{said(runs)}"
        time.sleep(0.05)
    committed_after = time.time() - signalled_at
    assert runs[1].command_rc() is None, "node 1's trainer should still be inside its long step"
    assert committed_after < 3 + 1.5 + len(slow_commit), f"fallback committed {committed_after:.1f}s after SIGTERM"
    evs = events(log)
    fallback = {e["host"]: e["step"] for e in evs if e["event"] == "deadline_fallback"}
    assert fallback == {"node0": 8, "node1": 8}, fallback
    assert {(e["rank"], e["host"]) for e in evs if e["event"] == "persist" and e["step"] == 8} == \
        {(0, "node0"), (1, "node1")}
    man = json.loads((ckpt / "step_00000008" / "easyckpt_manifest.json").read_text())
    assert man["world_size"] == 2
    if signalled == "every trainer":
        assert c.wait(runs, TIMEOUT) == [0, 0], said(runs)
        # node 0 had passed its safe point 9 when the signal came: the earliest step all can stop at is 10
        saves = {(e["rank"], e["step"]) for e in events(log) if e["event"] == "sigterm_save"}
        assert saves == {(0, 10), (1, 10)}, saves
        assert committed_steps(ckpt)[-2:] == [8, 10]
        return
    time.sleep(max(0.0, signalled_at + 3 - time.time()))
    runs[1].kill()                        # the drained host goes down at its deadline
    assert runs[0].wait(120) != 0         # node 0's trainer fails on the broken collective; step 8 is stored
    again = c.launch(ckpt, 1, *args, tag="replaced")
    assert c.wait(again, TIMEOUT) == [0, 0], said(again)
    assert [starts(loss, r)[-1] for r in (0, 1)] == [8, 8]


# ---- kill -9 and node loss ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_kill9_of_every_trainer_on_every_node_resumes_from_memory(tmp_path, cluster, tmp_path_factory, nproc):
    """Every trainer on both nodes is killed at once; the agents survive. The job restarted on the same
    nodes resumes from memory on every rank, at most save_mem_interval back, bit-identical losses."""
    world = 2 * nproc
    ref = reference(tmp_path_factory, world)
    c = cluster(2)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    args = (*COMMON, "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", "0.05", "--idle-timeout", "60")
    runs = c.launch(ckpt, nproc, *args)
    wait_for_iteration(loss, 13, runs[1].proc, TIMEOUT, rank=world - 1)
    for r in runs:
        r.kill_trainers()
    for r in runs:
        r.wait_command(30)
        assert len(r.agents()) == 1, f"node {r.node.index}'s agent did not survive: {said(runs)}"
    reached = max(last_iteration(loss, rank) for rank in range(world))
    again = c.relaunch(ckpt, nproc, *args)
    for p in again:
        assert p.wait(timeout=TIMEOUT) == 0, f"{said(runs)}\n" + "\n".join(
            c.log("relaunch", i).read_text()[-2500:] for i in range(2))
    resumed = {starts(loss, r)[-1] for r in range(world)}
    assert len(resumed) == 1 and reached - resumed.copy().pop() <= MEM, f"reached {reached}, resumed {resumed}"
    loads = [e for e in events(log) if e["event"] == "load" and e["step"] in resumed]
    assert {(e["rank"], e["host"], e["source"]) for e in loads} == \
        {(r, host, "memory") for r, host in ranks_by_node(2, nproc).items()}, loads
    assert c.wait(runs, 60) == [-9, -9]     # torchrun was killed; the agents leave after the job's bye
    assert_losses(loss, ref)


def lose_the_last_node(c, ckpt: Path, loss: Path, log: Path, args: tuple, script: Optional[Path] = None):
    """The job (one rank per node; ``script``: train_cmds') runs until its last rank trained iteration 15; then its
    node is lost (killed: trainers, agent, /dev/shm), once it has replicated step 12 or later, and the others'
    trainers fail on the broken collective. (the runs, the newest step that node replicated, the last iteration its
    rank trained)"""
    runs = c.launch(ckpt, 1, *args, script=script)
    last = len(runs) - 1
    wait_for_iteration(loss, 15, runs[last].proc, TIMEOUT, rank=last)
    replicated = newest_replica(log, f"node{last}")
    runs[last].kill()
    reached = last_iteration(loss, last)
    assert replicated is not None and replicated >= 12, f"node {last}'s snapshots were not replicated: {replicated}"
    assert [r.wait_command(120) != 0 for r in runs[:last]] == [True] * last, \
        f"the other nodes' trainers should fail when node {last} is lost: {said(runs[:last])}"
    return runs, replicated, reached


def test_a_lost_node_replaced_resumes_from_its_replica_in_a_peers_memory(tmp_path, cluster, tmp_path_factory):
    """Node 1 is lost (its namespace killed: trainers, agent and /dev/shm); node 0's trainer fails on the
    broken collective, its agent lives on, holding node 1's replica. A replacement node 1 (empty memory) and
    node 0 restart the job: rank 1 pulls its state from node 0's memory (source "peer", checksummed), rank 0
    reads its own; no iteration beyond save_mem_interval is lost, nothing is read from storage, and the
    losses equal the uninterrupted run's."""
    ref = reference(tmp_path_factory, 2)
    c = cluster(2)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    args = (*COMMON, "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", "0.05", "--idle-timeout", "60")
    runs, replicated, reached = lose_the_last_node(c, ckpt, loss, log, args)
    assert len(runs[0].agents()) == 1, "node 0's agent outlives its trainer"
    sent = [e for e in events(log) if e["event"] == "replica_sent" and e["host"] == "node1"]
    assert sent and {e["node"] for e in sent} == {0}, f"node 1 replicated to node 0: {sent}"
    status = runs[0].enter([sys.executable, "-m", "easyckpt.cli", "status", str(ckpt)], tmp_path / "status.out")
    assert status.wait(timeout=60) == 0
    held = (tmp_path / "status.out").read_text()
    assert "holds rank 1 of node 1: step" in held and "replica    rank    1 slot" in held, held
    node0, node1 = c.train_cmds(ckpt, 1, *args)
    # torchrun restarted on the surviving node (its agent and memory as they are) and on a replacement; node 0's
    # rank tells its agent the new run's table (and secret) a second late: rank 1 must not ask for its replicas
    # before then (it did, found node 0's agent refusing the old secret's handshake, and resumed from storage)
    late = {"EASYCKPT_FAULTS": "trainer.before_peers@0=sleep:1"}
    again = [runs[0].enter(node0, c.log("replaced", 0), late), c.nodes[1].launch(node1, c.log("replaced", 1)).proc]
    assert [p.wait(timeout=TIMEOUT) for p in again] == [0, 0], "\n".join(
        c.log("replaced", i).read_text()[-2500:] for i in range(2))
    c.wait([runs[0], c.nodes[1].current], 60)
    resumed = {starts(loss, r)[-1] for r in (0, 1)}
    # the newest step node 1 had replicated when it was lost (how far that lags a kill at a random moment is
    # measured by the benchmark: benchmarks/bench_replicas.py)
    assert len(resumed) == 1 and replicated <= min(resumed) < reached, f"rank 1 reached {reached}, replicated " \
        f"{replicated}, resumed at {resumed}"
    step = resumed.pop()
    assert step % 10, f"step {step} is a storage step (storage interval 10): resumed from storage?"
    loads = {(e["rank"], e["source"]) for e in events(log) if e["event"] == "load" and e["step"] == step}
    assert loads == {(0, "memory"), (1, "peer")}, loads
    pulled = [e for e in events(log) if e["event"] == "replica_restore" and e["step"] == step]
    assert [(e["rank"], e["node"], e["host"]) for e in pulled] == [(1, 0, "node1")] and pulled[0]["bytes"] > 0, pulled
    assert "from a peer node's memory" in c.log("replaced", 0).read_text()
    assert_losses(loss, ref)


STORE_PROBE = """
import datetime, json, sys
from torch.distributed import TCPStore
store = TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=datetime.timedelta(seconds=20))
print(json.dumps(store.list_keys()))
"""


def test_the_replica_secret_is_not_in_the_jobs_store_and_replicas_still_flow(tmp_path, cluster):
    """Row 42: any host that reaches the job's c10d store (no authentication) lists its keys from another
    node's network: the agents' endpoints are there, the replica secret is not (before: `easyckpt/<job>/secret`
    was, and with it a stranger fetched rank 0's snapshot and planted a forged replica); the nodes' agents
    still authenticate each other with the secret the ranks exchanged over their process group."""
    c = cluster(2)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    cmds = c.train_cmds(ckpt, 1, *COMMON, "--iters", "150", "--loss-file", str(loss), "--log-file", str(log),
                        "--step-sleep", "0.1", "--idle-timeout", "2")
    port = next(a.split("=", 1)[1] for a in cmds[0] if a.startswith("--master_port="))
    runs = [node.launch(cmd, c.log("run", node.index)) for node, cmd in zip(c.nodes, cmds)]
    wait_for_iteration(loss, 8, runs[1].proc, TIMEOUT, rank=1)     # the job runs on while the probe looks
    probe = runs[1].enter([sys.executable, "-c", STORE_PROBE, c.nodes[0].addr, port], tmp_path / "probe.out")
    assert probe.wait(timeout=60) == 0, (tmp_path / "probe.out").read_text()[-2000:]
    keys = json.loads((tmp_path / "probe.out").read_text().strip().splitlines()[-1])
    job = ckpt_job(ckpt)
    assert any(k.endswith(f"easyckpt/{job}/agent0") for k in keys), keys
    assert not [k for k in keys if "secret" in k], keys
    assert c.wait(runs, TIMEOUT) == [0, 0]
    sent = [e for e in events(log) if e["event"] == "replica_sent"]
    assert {e["host"] for e in sent} == {"node0", "node1"}, "the agents did not authenticate each other"


def ckpt_job(ckpt: Path) -> str:
    from harness import job_id
    return job_id(ckpt)


@pytest.mark.slow
def test_two_lost_nodes_of_one_replica_group_resume_from_storage_loudly(tmp_path, cluster, tmp_path_factory):
    """Node 1 and node 2, which holds node 1's replica, are lost together (3 nodes, replication_factor 2):
    rank 1's state is nowhere in memory, so every rank resumes from the newest committed step, with a
    console line that says why, and the losses still equal the uninterrupted run's."""
    common = ("--iters", str(N), "--mem-interval", str(MEM), "--storage-interval", "4", "--max-ckpt", "2")
    ref = reference(tmp_path_factory, 3, common)
    c = cluster(3)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    args = (*common, "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", "0.05", "--idle-timeout", "60")
    runs = c.launch(ckpt, 1, *args)
    wait_for_iteration(loss, 15, runs[1].proc, TIMEOUT, rank=1)
    runs[1].kill()
    runs[2].kill()
    assert runs[0].wait_command(120) != 0
    time.sleep(1)          # node 0's agent persists rank 0's newest snapshot; it cannot commit without the others
    newest = committed_steps(ckpt)[-1]
    cmds = c.train_cmds(ckpt, 1, *args)
    again = [runs[0].enter(cmds[0], c.log("replaced", 0))] + \
        [c.nodes[i].launch(cmds[i], c.log("replaced", i)).proc for i in (1, 2)]
    assert [p.wait(timeout=TIMEOUT) for p in again] == [0, 0, 0], "\n".join(
        c.log("replaced", i).read_text()[-2500:] for i in range(3))
    c.wait([runs[0], c.nodes[1].current, c.nodes[2].current], 60)
    assert [starts(loss, r)[-1] for r in range(3)] == [newest] * 3
    loads = {(e["rank"], e["source"]) for e in events(log) if e["event"] == "load" and e["step"] == newest}
    assert loads == {(0, "storage"), (1, "storage"), (2, "storage")}, loads
    out = c.log("replaced", 0).read_text()
    assert "rank(s) [1] have no snapshot in memory, neither on their node nor on a peer node" in out, out[-3000:]
    assert_losses(loss, ref)


# ---- a job restarted on fewer nodes: resharded from memory (issue 53) ----------------------------------------

def resumed_from_storage(tmp_path_factory, first: int, then: int, step: int,
                         common: tuple = tuple(COMMON)) -> Dict[int, Dict[int, str]]:
    """rank -> iteration -> loss of a job of ``first`` ranks on one host that stops at ``step`` (committed by its
    finalize) and is resumed by ``then`` ranks from storage: what a reshard of ``step`` from memory must equal."""
    d = tmp_path_factory.mktemp(f"storage{first}to{then}")
    run(train_cmd(d / "ckpt", first, *common, "--iters", str(step)), timeout=TIMEOUT)
    wait_no_agent(d / "ckpt")
    run(train_cmd(d / "ckpt", then, *common, "--loss-file", str(d / "loss"), "--log-file", str(d / "log")),
        timeout=TIMEOUT)
    wait_no_agent(d / "ckpt")
    assert {(e["step"], e["source"]) for e in events(d / "log") if e["event"] == "load" and e["step"]} == \
        {(step, "storage")}
    return {r: losses(d / "loss", r) for r in range(then)}


def assert_same_after(loss: Path, ref: Dict[int, Dict[int, str]], step: int) -> None:
    for rank, want in ref.items():
        got = losses(loss, rank)
        after = [i for i in got if i > step]
        assert after == list(range(step + 1, N + 1)), f"rank {rank}: iterations {sorted(got)}"
        diff = [i for i in after if got[i] != want[i]]
        assert not diff, f"rank {rank}: losses differ from the resume from storage at iterations {diff}"


def test_a_job_restarted_on_fewer_nodes_resumes_resharded_from_their_memory(tmp_path, cluster, tmp_path_factory):
    """Node 3 of 4 (one rank each; node i's replicas on node i + 1) is lost and the job restarts on nodes 0-2:
    world size 4 -> 3. Old ranks 0-2 are in their own nodes' slots and rank 3 in node 0's replica slots, so the
    step is resharded from memory: rank 2, whose node holds no copy of rank 0's slot (the model and optimizer),
    receives it from node 0 over the job's process group, checksummed. Nothing is read from storage, rank 0's
    console says where the state came from, and the losses equal those of a resume of the same step from storage."""
    c = cluster(4)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    args = (*COMMON, "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", "0.05", "--idle-timeout", "60")
    runs, replicated, _ = lose_the_last_node(c, ckpt, loss, log, args)
    cmds = c.train_cmds(ckpt, 1, *args, only=3)
    again = [runs[i].enter(cmds[i], c.log("fewer", i)) for i in range(3)]
    assert [p.wait(timeout=TIMEOUT) for p in again] == [0, 0, 0], "\n".join(
        c.log("fewer", i).read_text()[-2500:] for i in range(3))
    c.wait(runs[:3], 60)
    resumed = {starts(loss, r)[-1] for r in range(3)}
    assert len(resumed) == 1 and replicated <= min(resumed), f"replicated {replicated}, resumed at {resumed}"
    step = resumed.pop()
    assert step % 10, f"step {step} is a storage step (storage interval 10): this proves nothing about memory"
    loads = {e["rank"]: e for e in events(log) if e["event"] == "load" and e["step"] == step}
    assert sorted(loads) == [0, 1, 2] and {(e["source"], e["saved_world_size"], e["path"]) for e in loads.values()} \
        == {("resharded", 4, None)}, loads
    assert loads[0]["moved"] == 0 and loads[2]["moved"] > 0, loads
    out = c.log("fewer", 0).read_text()
    assert f"resumed step {step} from memory, resharded 4 → 3 ranks: the slots of 3 nodes and 1 replica held by " \
           f"peers; " in out and ", 0 bytes read from storage" in out, out[-3000:]
    assert_same_after(loss, resumed_from_storage(tmp_path_factory, 4, 3, step), step)


def halved(c, ckpt: Path, loss: Path, log: Path, args: tuple, kill_at: int, first: tuple = (), then: tuple = (),
           **script) -> Tuple[int, Dict[int, dict]]:
    """The job on 2 nodes × 2 ranks (``args``, and ``first``), every trainer killed once rank 3 trained ``kill_at``
    while the agents live on, restarted with one rank per node (``args``, and ``then``), run to its end; each rank
    must have resumed from memory, resharded, having received slots from the other node. (the step resumed, each
    rank's load event). ``script``: train_cmds' (script, save_flag) for another training script."""
    runs = [node.launch(cmd, c.log("run", node.index))
            for node, cmd in zip(c.nodes, c.train_cmds(ckpt, 2, *args, *first, **script))]
    wait_for_iteration(loss, kill_at, runs[1].proc, TIMEOUT, rank=3)
    wait_for_snapshots(log, kill_at, 4, runs[1].proc)    # (the loss is written before the step's snapshot)
    for r in runs:
        r.kill_trainers()
    for r in runs:
        r.wait_command(30)
        assert len(r.agents()) == 1, f"node {r.node.index}'s agent did not survive: {said(runs)}"
    again = [r.enter(cmd, c.log("relaunch", r.node.index))
             for r, cmd in zip(runs, c.train_cmds(ckpt, 1, *args, *then, **script))]
    assert [p.wait(timeout=TIMEOUT) for p in again] == [0, 0], "\n".join(
        c.log("relaunch", i).read_text()[-2500:] for i in range(2))
    c.wait(runs, 60)
    step = starts(loss, 0)[-1]
    loads = {e["rank"]: e for e in events(log) if e["event"] == "load" and e["step"] == step}
    assert sorted(loads) == [0, 1] and {(e["source"], e["saved_world_size"]) for e in loads.values()} == \
        {("resharded", 4)} and loads[0]["moved"] > 0 and loads[1]["moved"] > 0, loads
    return step, loads


def test_fsdp2_on_half_the_ranks_reshards_from_the_nodes_memory(tmp_path, cluster, tmp_path_factory):
    """FSDP2 on 2 nodes × 2 ranks without replicas (replication_factor 1); every trainer is killed, the agents
    live on, and the job restarts with one rank per node: data-parallel 4 -> 2. Each node holds only its own two
    ranks' shards, so each new rank receives the other node's two slots over the process group, and DCP's
    planner reshards the four ranks' chunks in memory (engine/load/dcpmemory.py). Nothing is read from storage,
    and the losses equal those of a resume of the same step from storage (DCP's reader on the committed files)."""
    common = ("--fsdp", *COMMON, "--replication-factor", "1")
    c = cluster(2)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    args = (*common, "--loss-file", str(loss), "--log-file", str(log), "--idle-timeout", "60")
    step, _ = halved(c, ckpt, loss, log, args, 13, first=("--step-sleep", "0.05"))
    assert step % 10, f"step {step} is a storage step (storage interval 10): this proves nothing about memory"
    out = c.log("relaunch", 0).read_text()
    assert f"resumed step {step} from memory, resharded 4 → 2 ranks: the slots of 2 nodes; " in out, out[-3000:]
    assert_same_after(loss, resumed_from_storage(tmp_path_factory, 4, 2, step, common), step)


@pytest.mark.slow
def test_zero3_on_half_the_ranks_writes_the_step_out_of_the_nodes_memory_on_each_node(tmp_path, cluster):
    """DeepSpeed ZeRO-3 on 2 nodes × 2 ranks without replicas; every trainer is killed, the agents live on, and the
    job restarts with one rank per node (4 -> 2). Each node's first rank receives the other node's two slots and
    writes the step out in its own /dev/shm (engine/load/render.py) and converts it to DeepSpeed's universal checkpoint
    there too, beside it; nothing of the step goes to or comes from the save dir, and the losses after it agree with a
    resume of the same step from storage."""
    from harness import ROOT
    script = ROOT / "examples" / "deepspeed" / "train.py"
    c = cluster(2)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    train = ("--zero", "3", "--dropout", "0", "--global-batch", "12", "--iters", "16")
    args = (*train, "--replication-factor", "1", "--loss-file", str(loss), "--log-file", str(log), "--idle-timeout",
            "60")
    step, _ = halved(c, ckpt, loss, log, args, 8, first=("--step-sleep", "0.2"), script=script)
    assert last_iteration(loss, 0) == 16
    into = {e["rank"]: e["into"] for e in events(log) if e["event"] == "convert" and e["step"] == step}
    assert sorted(into) == [0, 1] and all(v.startswith("/dev/shm/") and os.path.basename(os.path.dirname(v)).startswith(
        "easyckpt-render-") for v in into.values()), into      # in each node's memory, not the save dir
    ref = tmp_path / "ref"
    run(script_cmd(script, 4, "--save-dir", str(ref / "ckpt"), *train, "--iters", str(step), torchrun=True),
        timeout=400)
    wait_no_agent(ref / "ckpt")
    run(script_cmd(script, 2, "--save-dir", str(ref / "ckpt"), *train, "--loss-file", str(ref / "loss"),
                   torchrun=True), timeout=400)
    wait_no_agent(ref / "ckpt")
    for rank in (0, 1):
        assert_losses_close(losses(loss, rank), losses(ref / "loss", rank), range(step + 1, 17), rel=1e-6)


@pytest.mark.slow
def test_zero3_restarted_on_fewer_nodes_resumes_resharded_from_their_memory_and_replicas(tmp_path, cluster):
    """DeepSpeed ZeRO-3 on 4 nodes × 1 rank (node i's replicas on node i + 1): node 3 is lost and the job restarts on
    nodes 0-2, world size 4 -> 3. Rank 3's slot comes from node 0's replica; each node receives the slots it lacks,
    writes the step out and converts it to DeepSpeed's universal checkpoint in its own /dev/shm. Nothing is read from
    storage, and the losses after it agree with a resume of the same step from storage (4 -> 3 ranks on one host)."""
    from harness import ROOT
    script = ROOT / "examples" / "deepspeed" / "train.py"
    c = cluster(4)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    train = ("--zero", "3", "--dropout", "0", "--global-batch", "12", "--storage-interval", "10", "--iters", "20")
    args = (*train, "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", "0.1", "--idle-timeout", "120")
    runs, replicated, _ = lose_the_last_node(c, ckpt, loss, log, args, script=script)
    cmds = c.train_cmds(ckpt, 1, *args, only=3, script=script)
    again = [runs[i].enter(cmds[i], c.log("fewer", i)) for i in range(3)]
    assert [p.wait(timeout=TIMEOUT) for p in again] == [0, 0, 0], "\n".join(
        c.log("fewer", i).read_text()[-2500:] for i in range(3))
    c.wait(runs[:3], 60)
    step = starts(loss, 0)[-1]
    assert replicated <= step and step % 10, f"replicated {replicated}, resumed at {step} (storage interval 10)"
    loads = {e["rank"]: e for e in events(log) if e["event"] == "load" and e["step"] == step}
    assert sorted(loads) == [0, 1, 2] and {(e["source"], e["saved_world_size"]) for e in loads.values()} == \
        {("resharded", 4)} and all(e["moved"] > 0 for e in loads.values()), loads
    into = {e["rank"]: e["into"] for e in events(log) if e["event"] == "convert" and e["step"] == step}
    assert sorted(into) == [0, 1, 2] and all(v.startswith("/dev/shm/") for v in into.values()), into
    out = c.log("fewer", 0).read_text()
    assert f"resumed step {step} from memory, resharded 4 → 3 ranks: the slots of 3 nodes and 1 replica held by " \
           f"peers; " in out and ", 0 bytes read from storage" in out, out[-3000:]
    ref = tmp_path / "ref"
    run(script_cmd(script, 4, "--save-dir", str(ref / "ckpt"), *train[:-1], str(step), torchrun=True), timeout=400)
    wait_no_agent(ref / "ckpt")
    run(script_cmd(script, 3, "--save-dir", str(ref / "ckpt"), *train, "--loss-file", str(ref / "loss"),
                   torchrun=True), timeout=400)
    wait_no_agent(ref / "ckpt")
    for rank in range(3):
        assert_losses_close(losses(loss, rank), losses(ref / "loss", rank), range(step + 1, 21), rel=1e-6)


@pytest.mark.slow
def test_megatron_on_half_the_ranks_writes_the_step_out_of_the_nodes_memory_on_each_node(tmp_path, cluster):
    """Megatron torch_dist with the distributed optimizer on 2 nodes × 2 ranks without replicas; every trainer is
    killed, the agents live on, and the job restarts with one rank per node (data-parallel 4 -> 2). Each node's first
    rank receives the other node's two slots and writes the step out in its own /dev/shm for Megatron's reader;
    nothing is read from storage, and the state right after the load equals a resume of the same step from storage
    (a run on one host), tensor by tensor."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")
    import torch
    from harness import ROOT
    from test_megatron_reshard import global_state
    script = ROOT / "examples" / "megatron" / "pretrain_gpt.py"
    c = cluster(2)
    ckpt, loss, log, dumps = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl", tmp_path / "mem"
    common = ("--cpu", "--quiet", "--ckpt-format", "torch_dist", "--use-distributed-optimizer", "--global-batch-size",
              "8", "--save-storage-interval", "5", "--agent-idle-timeout", "60", "--replication-factor", "1")
    args = (*common, "--iters", "12", "--loss-file", str(loss), "--ckpt-log", str(log))
    step, _ = halved(c, ckpt, loss, log, args, 7, first=("--step-sleep", "0.3"), then=("--dump-state", str(dumps)),
                     script=script, save_flag="--save")
    ref = tmp_path / "ref"
    run(script_cmd(script, 4, "--save", str(ref / "ckpt"), *common, "--iters", str(step), torchrun=True), timeout=400)
    wait_no_agent(ref / "ckpt")
    run(script_cmd(script, 2, "--save", str(ref / "ckpt"), *common, "--iters", "12", "--dump-state", str(ref / "d"),
                   torchrun=True), timeout=400)
    wait_no_agent(ref / "ckpt")
    from_memory, from_storage = global_state(dumps, "loaded"), global_state(ref / "d", "loaded")
    assert sorted(from_memory) == sorted(from_storage)
    for key in from_memory:
        assert torch.equal(from_memory[key], from_storage[key]), f"{key} differs from the resume from storage"


@pytest.mark.slow
def test_a_lost_node_that_does_not_come_back_resumes_the_smaller_job_from_memory(tmp_path, cluster,
                                                                                tmp_path_factory):
    """Node 1 is lost for good; the job restarts on node 0 alone (world size 2 -> 1). Node 0's memory holds rank
    0's snapshot and node 1's replica: together the step whole, so rank 0 resumes it from memory with nothing
    moved and nothing read from storage, with exactly the model state it had at that step, and its losses
    equal a resume of that step from storage."""
    c = cluster(2)
    ckpt, loss, log, dumps = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl", tmp_path / "dumps"
    dumps.mkdir()
    args = (*COMMON, "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", "0.05", "--idle-timeout", "60")
    runs, replicated, _ = lose_the_last_node(c, ckpt, loss, log, (*args, "--dump-dir", str(dumps)))
    alone = c.train_cmds(ckpt, 1, *args, "--dump-loaded", str(tmp_path / "loaded.pt"), only=1)[0]
    again = runs[0].enter(alone, c.log("alone", 0))
    assert again.wait(timeout=TIMEOUT) == 0, c.log("alone", 0).read_text()[-3000:]
    c.wait([runs[0]], 60)
    step = starts(loss, 0)[-1]
    assert replicated <= step and step % 10 and last_iteration(loss, 0) == N, (replicated, starts(loss, 0))
    loads = [(e["rank"], e["source"], e["moved"]) for e in events(log) if e["event"] == "load" and e["step"] == step]
    assert loads == [(0, "resharded", 0)], loads
    import torch
    want, got = torch.load(dumps / f"model_{step}.pt"), torch.load(tmp_path / "loaded.pt")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert_same_after(loss, resumed_from_storage(tmp_path_factory, 2, 1, step), step)


@pytest.mark.slow
def test_a_shard_in_no_nodes_memory_resumes_the_smaller_job_from_storage_saying_which(tmp_path, cluster,
                                                                                    tmp_path_factory):
    """Nodes 1 and 2 of 3 are lost together and the job restarts on node 0 alone (3 -> 1). Node 0 holds rank 0's
    slots and node 2's replica, but rank 1's state was on node 1 and its replica on node 2: no memory holds it, so
    the newest committed step serves, and rank 0's console names the rank that is missing."""
    common = ("--iters", str(N), "--mem-interval", str(MEM), "--storage-interval", "4", "--max-ckpt", "2")
    c = cluster(3)
    ckpt, loss, log = tmp_path / "ckpt", tmp_path / "loss", tmp_path / "audit.jsonl"
    args = (*common, "--loss-file", str(loss), "--log-file", str(log), "--step-sleep", "0.05", "--idle-timeout", "60")
    runs = c.launch(ckpt, 1, *args)
    wait_for_iteration(loss, 15, runs[1].proc, TIMEOUT, rank=1)
    runs[1].kill()
    runs[2].kill()
    assert runs[0].wait_command(120) != 0
    time.sleep(1)          # node 0's agent persists rank 0's newest snapshot; it cannot commit without the others
    newest = committed_steps(ckpt)[-1]
    alone = c.train_cmds(ckpt, 1, *args, only=1)[0]
    again = runs[0].enter(alone, c.log("alone", 0))
    assert again.wait(timeout=TIMEOUT) == 0, c.log("alone", 0).read_text()[-3000:]
    c.wait([runs[0]], 60)
    assert starts(loss, 0)[-1] == newest
    loads = [(e["rank"], e["source"]) for e in events(log) if e["event"] == "load" and e["step"] == newest]
    assert loads == [(0, "storage")], loads
    out = c.log("alone", 0).read_text()
    assert "is in memory only in part, so it is not resharded from memory (rank(s) [1] of its 3-rank run are in " \
           "no node's memory)" in out, out[-3000:]
    assert_same_after(loss, resumed_from_storage(tmp_path_factory, 3, 1, newest, common), newest)
