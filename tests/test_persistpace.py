"""The storage persists' pacing (engine/save/persistpace.py) under the snapshot budget. In process: a training
loop's steps fed to the budget, and an agent that writes each persisted step for a known time, one after the
other, while the steps that run beside a write take longer by a known share. What the pacing reads of the agent is
what a trainer reads: when each persist was requested, and the seconds each write took once its step committed.
A given interval and the default one are told apart in the Config. In real processes: a training loop
and its node agent, whose every write is slowed by a fault (a slow store)."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

import harness

from easyckpt.config import Config, check_values, storage_interval, storage_unset
from easyckpt.engine.save import persistpace as pp
from easyckpt.engine.save.budget import SnapshotBudget
from easyckpt.errors import ConfigError


class Loop:
    """One rank's loop and its node's agent. A plain step takes ``step`` s, ``slower`` times more while the
    agent writes; a snapshot adds ``snap`` s; each persist's write takes ``write`` s, started when the agent is
    free (one request waits while it writes; with both slots held the snapshot is skipped, as the Snapshotter
    does), and its seconds are known to the trainer once it ended."""

    def __init__(self, step: float, slower: float, write: float, snap: float = 0.0005, budget: float = 0.02):
        self.step, self.slower, self.write, self.snap = step, slower, write, snap
        self.done: Dict[int, Tuple[float, float]] = {}            # step -> (write ended, seconds)
        self.pace = pp.PersistPace(1, 5, budget, self.written)
        self.budget = SnapshotBudget(1, budget, pace=self.pace)
        self.now, self.agent_free, self.persisted = 0.0, 0.0, []  # type: float, float, List[int]
        self.busy = 0.0                                            # seconds of steps the writes slowed

    def written(self) -> Dict[int, float]:
        return {s: secs for s, (end, secs) in self.done.items() if end <= self.now}

    def run(self, steps: int, start: int = 1) -> None:
        b = self.budget
        for s in range(start, start + steps):
            b.tick(s, self.now)
            if b.agreement_due(s):
                b.agree([b.vote()])
            every = self.pace.every
            b.persist_every = every
            persist = s % every == 0
            took = persist or b.due(s)
            if took:
                b.took()
            if persist and self.agent_free - self.now > self.write:
                persist = took = False                    # both slots held by persists: the snapshot is skipped
            if persist:
                self.persisted.append(s)
                self.pace.requested(s, self.now)
                begin = max(self.now, self.agent_free)
                self.agent_free = begin + self.write
                self.done[s] = (self.agent_free, self.write)
            mid = self.now + self.step / 2
            writing = any(end - secs <= mid < end for end, secs in self.done.values())
            extra = self.step * self.slower if writing else 0.0
            self.busy += extra
            self.now += self.step + extra + (self.snap if took else 0.0)


def test_writes_that_slow_the_loop_are_spaced_out_until_their_cost_is_within_half_the_budget():
    """0.4 s writes against 10 ms steps, each step beside one 40 % slower: every 5 steps the agent writes back to
    back (x1.4). The spacing grows until steps without a write are seen, then is set from the measured cost:
    0.4 s of writing may slow the loop 1 % (half of max_overhead=0.02) when it comes every 16 s or more."""
    loop = Loop(step=0.01, slower=0.4, write=0.4)
    loop.run(400)
    assert loop.pace.every > 5                                   # guessed from the write's seconds while saturated
    loop.run(12000, start=401)
    every = loop.pace.every
    assert 1200 <= every <= 3600, every                          # 16 s of 10 ms steps, give or take the noise
    # over the last stretch, what the writes cost the loop per step, as a stopwatch would see it
    before_busy, before = loop.busy, loop.now
    loop.run(4 * every, start=12401)
    assert (loop.busy - before_busy) / (loop.now - before) <= 0.02
    assert all(s % 5 == 0 for s in loop.persisted)
    c, every = loop.budget.cadence(), loop.pace.every
    assert c.persist_every == every and c.persist_paced
    assert f"storage persists every {every} steps" in c.words()
    assert "save_storage_interval left at its default" in c.words()


def test_a_cadence_said_as_the_persists_move_apart_counts_them_at_their_new_spacing():
    """The persists are snapshots too, counted in the rate of the window before an agreement. When that agreement
    spaces them further apart, the cost it states is the new spacing's, not the window's (a line said "3.4% of step
    time" against max_overhead=0.02 at a cost of 1.8 %)."""
    loop = Loop(step=0.01, slower=0.4, write=0.4, snap=0.004)
    b, real, moved = loop.budget, loop.budget.agree, []

    def agree(votes):
        before = b.persist_every
        cadence, say = real(votes)
        if cadence is not None and b.persist_every != before:
            moved.append(cadence)
        return cadence, say
    b.agree = agree
    loop.run(6000)
    assert moved, "the persists were never spaced out"
    assert all(c.rate == 0 and c.per_step == pytest.approx(c.cost / c.every) for c in moved), [c.to_info() for c in moved]


def test_with_a_snapshot_every_step_the_steps_after_one_measure_the_writes():
    """A cheap snapshot (1 % of the step) is taken every step; the only plain steps are the budget's probes, one in
    16. The steps after a snapshot, beside a write and beside none, measure what the writes cost."""
    loop = Loop(step=0.01, slower=0.4, write=0.4, snap=0.0001)
    loop.run(12000)
    assert loop.budget.every == 1
    assert 1200 <= loop.pace.every <= 3600, loop.pace.every


def test_writes_the_loop_does_not_feel_stay_every_5_steps():
    """On a machine with cores to spare, a step beside a write takes no longer: the persists stay where they
    start (the old default), whatever the agent's duty."""
    loop = Loop(step=0.01, slower=0.0, write=0.02)
    loop.run(6000)
    assert loop.pace.every == 5
    assert loop.persisted == list(range(5, 6001, 5))


def test_the_spacing_comes_back_when_the_writes_get_cheap():
    loop = Loop(step=0.01, slower=0.4, write=0.2)
    loop.run(8000)
    far = loop.pace.every
    assert far >= 100
    loop.write, loop.slower = 0.002, 0.05                        # a faster disk, say, or the other job gone
    loop.run(40000, start=8001)
    assert loop.pace.every * pp.RELAX <= far, (far, loop.pace.every)


def test_never_further_apart_than_max_seconds_of_training():
    loop = Loop(step=0.01, slower=1.0, write=30.0)               # 30 s writes doubling a step: 2 persists an hour
    loop.run(200000)
    assert loop.pace.every * 0.01 <= pp.MAX_SECONDS


def test_without_a_known_write_the_pacing_has_no_opinion():
    pace = pp.PersistPace(1, 5, 0.02, dict)
    for i in range(100):
        pace.step(i * 0.01 + 0.01, 0.01, i % 2 == 0)
    assert pace.want(1.0) == 0
    assert not pace.agree([0]) and pace.every == 5


def test_the_ranks_persist_alike_the_slowest_rank_decides():
    """Every rank must persist the same steps: the largest wish wins, on every rank."""
    a, b = (pp.PersistPace(2, 6, 0.02, dict) for _ in range(2))
    for pace in (a, b):
        assert pace.agree([0, 24, 12])
        assert pace.every == 24


def test_a_given_interval_is_kept_and_the_default_one_starts_at_5_rounded_to_the_memory_interval():
    assert storage_unset(Config(save_dir="/x")) and Config(save_dir="/x").save_storage_interval == 5
    assert not storage_unset(Config(save_dir="/x", save_storage_interval=5))     # 5 given: kept exactly
    assert storage_interval(Config(save_dir="/x")) == 5
    assert storage_interval(Config(save_dir="/x", save_mem_interval=2)) == 6
    assert storage_interval(Config(save_dir="/x", save_mem_interval=2, save_storage_interval=4)) == 4
    check_values(Config(save_dir="/x", save_mem_interval=2))       # 5 was refused here before: not a multiple
    with pytest.raises(ConfigError, match="not a multiple"):
        check_values(Config(save_dir="/x", save_mem_interval=2, save_storage_interval=5))


LOOP = Path(__file__).resolve().parent / "budget_loop.py"


def _persisted(save: Path) -> Tuple[List[int], List[dict]]:
    events = harness.events(save / "easyckpt.log")
    return ([e["step"] for e in events if e["event"] == "persist"],
            [e for e in events if e["event"] == "budget" and not e.get("last")])


@pytest.mark.parametrize("given", [None, 5])
def test_a_store_slower_than_the_persists_spaces_the_default_ones_and_keeps_a_given_interval(tmp_path, given):
    """10 ms steps; every persist takes the agent 0.3 s more (agent.persist_file=sleep:0.3), so persisting every
    5 steps (50 ms) it could never keep up. Left at its default, the persists are spaced out until the agent is
    idle half the time at least (0.3 s of writing every 0.6 s of training: 60 steps or more), said on rank 0's
    console; given as 5, every 5th step is handed to the agent to the end, as asked (the agent persists what
    its slots still hold)."""
    save = tmp_path / "ckpt"
    cmd = [sys.executable, str(LOOP), "--steps", "900", "--sleep", "0.01", "--dir", str(save), "--max-overhead",
           "0.02", "--storage-interval", str(given or 0), "--out", str(tmp_path / "began.json")]
    out = harness.run(cmd, {"EASYCKPT_FAULTS": "agent.persist_file=sleep:0.3"}, timeout=240)
    persisted, agreed = _persisted(save)
    assert agreed, "no agreement on a cadence was recorded"
    spacing = [e["persist_every"] for e in agreed]
    if given:
        assert set(spacing) == {5} and not any(e["persist_paced"] for e in agreed)
        assert all(s % 5 == 0 for s in persisted)
        return
    assert all(e["persist_paced"] for e in agreed)
    assert persisted[0] == 5 and spacing[-1] >= 60, (persisted[:5], spacing)   # from every 5 steps to far apart
    # the persists handed over since the spacing last changed are on it (every rank agreed on the same steps); it
    # may have changed before the first agreement recorded (the one that decided the snapshots' cadence)
    changed = [i for i in range(1, len(spacing)) if spacing[i] != spacing[i - 1]]
    since = agreed[changed[-1] if changed else 0]["step"]
    late = [s for s in persisted if since < s < 900]      # (900: the last step, persisted at finalize)
    assert late and all(s % spacing[-1] == 0 for s in late), (spacing, late)
    said = re.findall(r"storage persists every (\d+) steps", out.stdout + out.stderr)
    assert said and int(said[-1]) >= 60, said
    status = harness.run([sys.executable, "-m", "easyckpt.cli", "status", str(save)], timeout=60)
    assert re.search(r"persists   every \d+ step\(s\) \(save_storage_interval left at its default", status.stdout), \
        status.stdout
