"""In-process unit tests of the agent's state machines and the protocol messages: no subprocess, no
socket, no disk. The commit coordinator and the grace clock run on a fake clock; the coordinator's
view of the staging dirs (which ranks' markers are there) is a dict the test fills."""
from __future__ import annotations

import json
from typing import Dict, List, Optional, Set

import pytest

from easyckpt.agent.coordinator import (
    Answer,
    Cancel,
    Committed,
    Coordinator,
    Error,
    Log,
    RemoveStaging,
    Submit,
)
from easyckpt.agent.grace import Grace
from easyckpt.agent.jobs import AbandonJob, CommitJob, DropJob, PersistJob, Result
from easyckpt.formats import protocol
from easyckpt.ipc import agentsocket


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Node:
    """A coordinator with a fake clock and fake staging dirs; ``persisted`` plays the worker."""

    def __init__(self, world_size: int = 2, commit_timeout: float = 30.0):
        self.clock = FakeClock()
        self.staging: Dict[int, Set[int]] = {}
        self.co = Coordinator(commit_timeout, self.clock, lambda step: self.staging.get(step))
        for rank in range(world_size):
            self.co.hello(rank, world_size)
        self.actions: List[object] = []

    def take(self) -> List[object]:
        out = self.co.take()
        self.actions += out
        return out

    def jobs(self, out: List[object]) -> List[object]:
        return [a.job for a in out if isinstance(a, Submit)]

    def persisted(self, job: PersistJob, error: Optional[str] = None) -> List[object]:
        if error is None:
            self.staging.setdefault(job.step, set()).add(job.rank)
        self.co.on_result(Result(job, error, seconds=0.5))
        return self.take()

    def committed(self, job: CommitJob, error: Optional[str] = None) -> List[object]:
        if error is None:
            self.staging.pop(job.step, None)
        self.co.on_result(Result(job, error))
        return self.take()

    def persist(self, rank: int, step: int, slot: int = 0) -> PersistJob:
        self.co.persist(rank, slot, step + 1, step)
        job, = self.jobs(self.take())
        assert isinstance(job, PersistJob) and (job.rank, job.step) == (rank, step)
        return job


def test_a_step_commits_once_every_ranks_shard_is_durable_and_the_last_flush_waits_for_the_commit():
    node = Node(world_size=2)
    first, last = node.persist(0, 5), node.persist(1, 5)
    node.co.flush("conn1", 1, 5, 0, 6)
    assert node.take() == [], "rank 1's flush is answered before its shard is durable"
    assert node.persisted(first) == []
    assert node.co.pending == {5: node.clock.now + 30.0}, "the step does not wait for the other rank's shard"
    out = node.persisted(last)
    commit, = node.jobs(out)
    assert commit == CommitJob(5, 2, 0, rank=1)
    assert not [a for a in out if isinstance(a, Answer)], "the flush is answered before the commit it waits for"
    out = node.committed(commit)
    assert Answer("conn1", 5, None) in out and Committed(5) in out
    assert node.co.newest_committed == 5 and not node.co.pending and not node.co.busy()


def test_a_step_whose_other_node_shard_arrives_later_commits_on_a_tick():
    node = Node(world_size=2)
    node.persisted(node.persist(0, 5))
    node.staging[5].add(1)          # another node's rank wrote its marker into the shared staging dir
    node.co.tick()
    commit, = node.jobs(node.take())
    assert commit == CommitJob(5, 2, 0)
    node.co.tick()
    assert node.take() == [], "a commit already on its way is asked for again"


def test_a_rank_missing_until_commit_timeout_fails_the_step_and_its_staging_goes():
    node = Node(world_size=2, commit_timeout=30.0)
    node.co.flush("conn0", 0, 5, 0, 6)
    job, = node.jobs(node.take())
    out = node.persisted(job)
    assert Answer("conn0", 5, None) in out
    node.clock.now += 29.0
    node.co.tick()
    assert node.take() == [] and 5 in node.co.pending
    node.clock.now += 2.0
    node.co.tick()
    out = node.take()
    error, = [a for a in out if isinstance(a, Error)]
    assert error.step == 5 and "commit timed out after 30.0s" in error.error and "ranks [1]" in error.error
    assert RemoveStaging(5) in out
    assert 5 in node.co.failed and not node.co.pending
    assert not node.co.shard_done(0, 5), "rank 0's shard of a failed step still counts as written"
    assert node.co.last_error is not None and node.co.last_error.startswith("step 5:")


def test_a_failed_persist_fails_the_step_and_answers_its_flush_with_the_error():
    node = Node(world_size=1)
    job = node.persist(0, 5)
    node.co.flush("conn0", 0, 5, 0, 6)
    node.take()
    out = node.persisted(job, error="OSError: [Errno 28] No space left on device")
    assert Answer("conn0", 5, "OSError: [Errno 28] No space left on device") in out
    assert RemoveStaging(5) in out and node.co.failed[5].startswith("rank 0: OSError")


def test_a_shard_written_after_its_step_failed_never_holds_the_agent_for_commit_timeout():
    """ENOSPC on rank 0's shard of the final step while rank 1's persist of it is queued: rank 1's shard, written
    after the failure (into space the failed one freed), fails too, at once, with the step's reason; nothing
    is left pending, so the agent is idle (and gives the job lock back) at once, not after commit_timeout
    (before: the step was pending again for 600 s, and the agent lived on about 11 minutes)."""
    node = Node(world_size=2, commit_timeout=600.0)
    node.co.flush("c0", 0, 5, 0, 6)
    node.co.flush("c1", 1, 5, 0, 6)
    first, second = node.jobs(node.take())
    enospc = "OSError: [Errno 28] No space left on device"
    out = node.persisted(first, error=enospc)
    assert Answer("c0", 5, enospc) in out and RemoveStaging(5) in out
    out = node.persisted(second)
    answer, = [a for a in out if isinstance(a, Answer)]
    assert answer.to == "c1" and answer.error and "step 5 failed: rank 0: OSError" in answer.error
    assert RemoveStaging(5) in out
    assert not node.co.pending and not node.co.busy(), node.co.pending
    # the trainers die; the agent persists step 5 again for them: rank 1 fits, rank 0 fails again
    node.co.trainers_died(5)
    node.take()
    first, second = node.persist(0, 5), node.persist(1, 5)
    node.persisted(first, error=enospc)
    node.persisted(second)
    assert not node.co.pending, "the step saved for dead trainers waits commit_timeout for a shard that failed"


def test_a_failed_commit_fails_the_step_and_a_later_step_still_commits():
    node = Node(world_size=1)
    commit, = node.jobs(node.persisted(node.persist(0, 5)))
    out = node.committed(commit, error="FileExistsError: step_00000005 is not an easyckpt checkpoint")
    assert RemoveStaging(5) in out and 5 in node.co.failed and Committed(5) not in out
    commit, = node.jobs(node.persisted(node.persist(0, 10)))
    assert Committed(10) in node.committed(commit)


def test_a_step_left_waiting_when_a_newer_one_commits_is_superseded_not_timed_out():
    node = Node(world_size=2)
    node.persisted(node.persist(0, 5))              # rank 1 skipped step 5: both its slots were busy
    node.persisted(node.persist(0, 10))
    commit, = node.jobs(node.persisted(node.persist(1, 10)))
    out = node.committed(commit)
    assert Submit(DropJob(5)) in out and 5 not in node.co.pending
    log, = [a for a in out if isinstance(a, Log) and a.event == "abandon"]
    assert log.fields["step"] == 5 and "ranks [1]" in log.fields["message"]
    node.co.on_result(Result(DropJob(5)))
    node.staging.pop(5)
    # a late shard of the superseded step is dropped at once, never committed after step 10
    out = node.persisted(node.persist(1, 5))
    assert Submit(DropJob(5)) in out and not [j for j in node.jobs(out) if isinstance(j, CommitJob)]


def test_the_trainers_death_abandons_other_steps_and_cancels_their_queued_persists():
    node = Node(world_size=2)
    node.persisted(node.persist(0, 5))               # step 5 waits for rank 1
    queued = node.persist(0, 10)
    node.co.trainers_died(keep=10)
    out = node.take()
    assert Cancel(10, 1) in out and Submit(AbandonJob(10)) in out
    assert 5 not in node.co.pending, "a step the dead trainers cannot complete still waits for commit_timeout"
    stale = node.persist(1, 7)                       # asked for in the new epoch: not cancelled
    node.co.cancelled([])                            # the loop's Cancel found nothing but step 10's (kept)
    assert stale.epoch == 1 and queued.epoch == 0
    # step 10 is what the agent saves for the dead trainers: its shards still commit
    node.persisted(queued)
    commit, = node.jobs(node.persisted(node.persist(1, 10)))
    assert commit.step == 10


def test_a_step_whose_last_shard_was_being_written_when_the_trainers_died_still_commits_before_the_abandon():
    """The trainers die while the worker writes the last shard of step 10: every shard of 10 becomes
    durable, so 10 commits, and only then does the other steps' staging go (the abandon must not remove
    10's staging under the persist)."""
    node = Node(world_size=1)
    writing = node.persist(0, 10)
    node.co.trainers_died(keep=12)
    out = node.take()
    assert not [j for j in node.jobs(out) if isinstance(j, AbandonJob)], "staging removed under a persist in flight"
    node.co.cancelled([])                            # it was running, not queued: nothing came off the queue
    assert not [j for j in node.jobs(node.take()) if isinstance(j, AbandonJob)]
    commit, abandon = node.jobs(node.persisted(writing))
    assert isinstance(commit, CommitJob) and commit.step == 10 and abandon == AbandonJob(12)
    assert Committed(10) in node.committed(commit)


def test_a_step_the_dead_trainers_left_incomplete_is_abandoned_once_its_persist_in_flight_ends():
    node = Node(world_size=2)
    writing = node.persist(0, 10)                    # rank 1's shard of 10 never comes
    node.co.trainers_died(keep=None)
    node.take()
    node.co.cancelled([])
    out = node.persisted(writing)
    assert node.jobs(out) == [AbandonJob(None)]


def test_a_step_saved_for_dead_trainers_never_commits_with_fewer_ranks_when_the_job_comes_back_smaller():
    """2 ranks (rank 1 on a node lost for good); the agent saves step 14 for its dead rank 0, and the job
    restarts alone (world size 1) while that persist runs. Step 14 lacks rank 1's shard: it must neither
    commit as a 1-rank step nor wait for a shard that never comes."""
    node = Node(world_size=2)
    node.co.trainers_died(keep=14)
    node.take()
    writing = node.persist(0, 14)
    node.co.new_trainers(world_size=1)
    node.co.hello(0, 1)
    out = node.take()
    assert Submit(DropJob(14)) in out and Cancel(None, 2) in out
    assert [a for a in out if isinstance(a, Log) and a.event == "abandon" and a.fields["step"] == 14]
    out = node.persisted(writing)
    assert not [j for j in node.jobs(out) if isinstance(j, CommitJob)], "a 2-rank step committed with 1 shard"
    node.co.tick()
    assert not node.jobs(node.take()) and 14 not in node.co.pending
    # the new trainers' own step commits with their world size, and their flush is not answered by the old shard
    node.co.flush("new", 0, 14, 1, 30)
    job, = node.jobs(node.take())
    assert job.world_size == 1 and job.generation == 30
    node.staging.pop(14, None)                       # the DropJob ran
    commit, = node.jobs(node.persisted(job))
    assert commit == CommitJob(14, 1, node.co.epoch, rank=0)


def test_a_step_saved_for_dead_trainers_still_commits_when_they_come_back_on_the_same_layout():
    node = Node(world_size=2)
    node.co.trainers_died(keep=14)
    node.take()
    writing = node.persist(0, 14)
    node.co.new_trainers(world_size=2)
    node.co.hello(0, 2)
    assert not [j for j in node.jobs(node.take()) if isinstance(j, DropJob)]
    node.persisted(writing)
    assert 14 in node.co.pending
    node.staging[14].add(1)                          # the other node's agent wrote its dead rank's shard
    node.co.tick()
    assert node.jobs(node.take()) == [CommitJob(14, 2, node.co.epoch)]


def test_cancelled_persists_are_no_longer_outstanding():
    node = Node(world_size=1)
    job = node.persist(0, 5)
    node.co.trainers_died(keep=None)
    node.take()
    node.co.cancelled([job])
    node.co.on_result(Result(AbandonJob(None)))
    assert not node.co.busy() and (0, 5) not in node.co.queued


def test_a_new_set_of_trainers_is_not_answered_by_the_earlier_ones_shards():
    node = Node(world_size=1)
    node.co.flush("old", 0, 5, 0, 6)
    commit, = node.jobs(node.persisted(*node.jobs(node.take())))
    assert Answer("old", 5, None) in node.committed(commit)
    node.co.new_trainers(world_size=1)
    out = node.take()
    assert Cancel(None, 1) in out
    node.co.flush("new", 0, 5, 0, 9)
    job, = node.jobs(node.take())
    assert job.generation == 9 and job.reason == "finalize", "the new run's flush was answered by the old shard"


def test_a_persist_asked_for_twice_is_queued_once():
    node = Node(world_size=1)
    node.persist(0, 5)
    node.co.persist(0, 0, 6, 5)
    node.co.flush("conn", 0, 5, 0, 6)
    assert node.jobs(node.take()) == []


def test_an_agent_that_does_not_serve_rank_0_never_commits():
    clock = FakeClock()
    co = Coordinator(30.0, clock, lambda step: {0, 1})
    co.hello(1, 2)
    co.persist(1, 0, 1, 5)
    job = co.take()[0].job
    co.on_result(Result(job))
    assert not [a for a in co.take() if isinstance(a, Submit)] and not co.pending


# ---- the grace clock ------------------------------------------------------------------------

def test_grace_deadline_reached_chooses_the_fallback_once_before_the_deadline():
    wall, mono = FakeClock(5000.0), FakeClock(100.0)
    grace = Grace(10.0, wall=wall, clock=mono)
    grace.wrote(2.0)                                 # reserve: max(1.0, 2 * 2.0) = 4 s before the deadline
    notice = grace.notice(wall.now - 1.0, "rank 0")  # the signal came 1 s ago: 9 s left
    assert notice == {"source": "rank 0", "deadline_in": 9.0, "fallback_in": 5.0}
    grace.agreed(40)
    mono.now += 4.9
    assert grace.due().fallback is False
    mono.now += 0.2
    assert grace.due().fallback is True
    assert grace.due().fallback is False, "the fallback is chosen twice"
    assert grace.due().leave is False, "a trainer's SIGTERM made the agent leave"


def test_the_agreed_steps_commit_serves_the_sigterm_and_stops_the_clock():
    wall, mono = FakeClock(5000.0), FakeClock(100.0)
    grace = Grace(10.0, wall=wall, clock=mono)
    grace.notice(wall.now, "rank 1")
    grace.agreed(40)
    assert grace.committed(39) is None
    wall.now += 3.0
    assert grace.committed(40) == 3.0
    assert grace.status() is None and grace.due().fallback is False
    mono.now += 60
    assert grace.due().fallback is False, "a served SIGTERM still chose the fallback"


def test_an_earlier_notice_wins_and_the_agents_own_sigterm_makes_it_leave_at_the_deadline():
    wall, mono = FakeClock(5000.0), FakeClock(100.0)
    grace = Grace(10.0, wall=wall, clock=mono)
    assert grace.notice(wall.now - 2.0, "rank 0") is not None
    assert grace.notice(wall.now - 1.0, "rank 1") is None, "a later notice moved the deadline"
    assert grace.own_sigterm() is None and grace.leaving   # the agent's own is later still
    assert grace.own_sigterm() is None
    grace.agreed(40)
    assert grace.committed(40) == 2.0 and grace.status() is not None, "a leaving agent stopped its clock"
    mono.now += 7.9
    assert grace.due() == grace.due().__class__(fallback=True, leave=False)
    mono.now += 0.2
    assert grace.due().leave is True


def test_the_agents_own_sigterm_starts_the_clock_when_no_trainer_said_so():
    wall, mono = FakeClock(5000.0), FakeClock(100.0)
    grace = Grace(10.0, wall=wall, clock=mono)
    assert grace.due().fallback is False and grace.due().leave is False
    assert grace.own_sigterm() == {"source": "agent", "deadline_in": 10.0, "fallback_in": 9.0}
    mono.now += 10.0
    due = grace.due()
    assert due.fallback and due.leave


# ---- protocol messages ----------------------------------------------------------------------

EXAMPLES = [protocol.Hello(rank=1, world_size=4, local_rank=1, pid=4242),
            protocol.Persist(rank=1, slot=0, generation=7, step=100),
            protocol.Flush(rank=1, step=100, slot=1, generation=8),
            protocol.Bye(rank=1),
            protocol.Term(rank=0, at=1712345678.25),
            protocol.TermStep(rank=0, step=120),
            protocol.Damaged(step=100, reason="manifest checksum mismatch"),
            protocol.Quarantine(step=100, reason="incompatible: another layout"),
            protocol.Status(),
            protocol.Listen(addr="10.213.77.2"),
            protocol.Peers(node=1, nnodes=2, ranks_per_node=2, secret="ab" * 32,
                           endpoints="0=10.213.77.1@40001,1=10.213.77.2@40002"),
            protocol.ReplicaList(rank=3),
            protocol.ReplicaFetch(rank=3, step=12)]


def test_there_is_a_typed_message_for_each_of_the_protocols_operations():
    assert sorted(protocol.OPS) == sorted(type(m).op for m in EXAMPLES)
    assert sorted(protocol.OPS) == ["bye", "damaged", "flush", "hello", "listen", "peers", "persist",
                                    "quarantine", "replica_fetch", "replica_list", "status", "term", "term_step"]


@pytest.mark.parametrize("fields, bad", [
    ({"addr": "10.0.0.1; rm -rf /"}, "not an IP address"),
    ({"endpoints": "0=10.0.0.1@1,0=10.0.0.2@2"}, "endpoint"),          # a node twice
    ({"endpoints": "0=10.0.0.1@1,5=10.0.0.2@2"}, "endpoint"),          # a node that does not exist
    ({"endpoints": "0=10.0.0.1@70000,1=10.0.0.2@2"}, "endpoint"),      # no such port
    ({"endpoints": "0=host.example@1,1=10.0.0.2@2"}, "endpoint"),      # names are not resolved here
    ({"secret": "short"}, "secret"),
    ({"node": 2}, "node 2 of 2"),
])
def test_a_peers_or_listen_message_with_a_bad_field_is_refused_naming_it(fields, bad):
    if "addr" in fields:
        wire = {"op": "listen", **fields}
    else:
        wire = {"op": "peers", "node": 0, "nnodes": 2, "ranks_per_node": 1, "secret": "ab" * 32,
                "endpoints": "0=10.0.0.1@1,1=10.0.0.2@2", **fields}
    with pytest.raises(protocol.BadMessage, match=bad):
        protocol.from_wire(wire)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).op)
def test_each_message_round_trips_through_the_wire(msg):
    line = protocol.encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert protocol.parse(line.rstrip(b"\n")) == (msg, None)
    keyed = protocol.encode(msg, key="k" * 64)
    assert protocol.parse(keyed) == (msg, "k" * 64)
    wire = json.loads(keyed)
    assert wire["op"] == type(msg).op and wire["key"] == "k" * 64


def test_the_wire_format_is_the_one_older_trainers_and_agents_speak():
    line = json.dumps({"op": "hello", "key": "abc", "rank": 0, "world_size": 2, "local_rank": 0, "pid": 9,
                       "a_field_from_a_newer_version": True}).encode()
    assert protocol.parse(line) == (protocol.Hello(0, 2, 0, 9), "abc")
    assert json.loads(protocol.encode(protocol.Persist(0, 1, 2, 3))) == \
        {"op": "persist", "rank": 0, "slot": 1, "generation": 2, "step": 3}
    term = protocol.parse(b'{"op": "term", "rank": 0, "at": 17}').message
    assert isinstance(term, protocol.Term) and isinstance(term.at, float)


@pytest.mark.parametrize("line, names", [
    ({"op": "persist", "slot": 0, "generation": 1, "step": 2}, "field 'rank' is missing"),
    ({"op": "persist", "rank": "0", "slot": 5}, "field 'rank' must be int"),
    ({"op": "flush", "rank": 0, "step": 1.5, "slot": 0, "generation": 1}, "field 'step' must be int"),
    ({"op": "bye", "rank": True}, "field 'rank' must be int"),
    ({"op": "term", "rank": 0, "at": "now"}, "field 'at' must be float"),
    ({"op": "damaged", "step": 1, "reason": "x" * 5000}, "field 'reason' is too long"),
    ({"op": "damaged", "step": 1}, "field 'reason' is missing"),
    ({"op": "launch_missiles"}, "unknown op 'launch_missiles'"),
    ({"rank": 0}, "unknown op 'None'"),
    ({"op": "bye", "rank": -1}, "field 'rank' = -1 is out of range"),
    ({"op": "term_step", "rank": 2 ** 62, "step": 1}, "field 'rank' = 4611686018427387904 is out of range"),
    ({"op": "hello", "rank": 3, "world_size": 2, "local_rank": 0, "pid": 1}, "rank 3 is not below world_size 2"),
    ({"op": "persist", "rank": 0, "slot": 2, "generation": 1, "step": 1}, "field 'slot' = 2 must be 0 or 1"),
])
def test_a_bad_message_raises_the_protocol_error_naming_what_is_wrong(line, names):
    with pytest.raises(protocol.BadMessage, match=names.replace("(", r"\(").replace("*", r"\*")):
        protocol.parse(json.dumps(line).encode())


def test_a_line_that_is_no_json_object_is_refused():
    for line, why in ((b"]]] not json", "not JSON"), (b"[1, 2]", "a message is a JSON object")):
        with pytest.raises(protocol.BadMessage, match=why):
            protocol.parse(line)


def test_a_message_built_in_code_is_checked_as_a_parsed_one_is():
    with pytest.raises(protocol.BadMessage, match="field 'step' = -5 is out of range"):
        protocol.Persist(rank=0, slot=0, generation=1, step=-5)
    with pytest.raises(protocol.BadMessage, match="rank 4 is not below world_size 4"):
        protocol.Hello(rank=4, world_size=4, local_rank=0, pid=1)


def test_a_key_that_is_not_a_string_counts_as_no_key():
    assert protocol.parse(b'{"op": "status", "key": 123}') == (protocol.Status(), None)


def test_the_line_reader_splits_lines_and_refuses_an_endless_one():
    reader = agentsocket.LineReader()
    assert list(reader.feed(b'{"op": "st')) == []
    assert list(reader.feed(b'atus"}\n\n{"op": "bye", "rank": 0}\n')) == [b'{"op": "status"}',
                                                                            b'{"op": "bye", "rank": 0}']
    with pytest.raises(protocol.BadMessage, match="a line longer than"):
        list(reader.feed(b"x" * (protocol.MAX_LINE + 1)))


def test_the_commit_a_persist_completes_runs_before_the_next_queued_persist_even_when_the_loop_is_slow():
    """The persist worker's hand-off (agent/persister.py): after a persist, the worker waits until the loop acted
    on its result, so the commit that result completes runs before the next step's persist already queued. The
    loop here takes 0.3 s to come round (a busy agent under load); without the hand-off the worker went straight
    on to step 10's persist, and an agent killed during it lost step 5's commit (tests/test_faults.py)."""
    import threading
    import time

    from easyckpt.agent.persister import Persister

    ran: List[str] = []
    started = threading.Event()

    def run(job):
        ran.append(f"{type(job).__name__} {job.step}")
        started.set()
        return Result(job)

    worker = Persister(run, threaded=True)
    worker.submit(PersistJob(5, 0, 0, 1))
    worker.submit(PersistJob(10, 0, 1, 2))
    assert started.wait(10)
    results: List[Result] = []
    deadline = time.monotonic() + 10
    while not results and time.monotonic() < deadline:
        time.sleep(0.3)                       # the loop comes round late
        results = worker.results()
    assert [r.job.step for r in results] == [5]
    worker.submit(CommitJob(5, 1))            # what the coordinator decides on step 5's result
    worker.acted()
    deadline = time.monotonic() + 10
    while len(ran) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
        worker.results()
        worker.acted()
    assert ran == ["PersistJob 5", "CommitJob 5", "PersistJob 10"]
