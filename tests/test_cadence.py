"""The replica cadence (agent/cadence.py), in process: fed snapshot gaps and sends as the sender sees them."""
from __future__ import annotations

import random

from easyckpt.agent.cadence import Cadence


def run(c: Cadence, gaps: int, step: float, send_cost: float, send_gaps: int = 1, send_seconds: float = 1.0,
        noise: float = 0.0, seed: int = 0, peer: bool = False, linger: float = 0.0) -> None:
    """``gaps`` snapshots ``step`` s apart (± ``noise`` × step, uniformly). A send starts as a snapshot lands
    when the cadence asks for one, and ends in the middle of its ``send_gaps``-th gap (``send_seconds`` of
    its own work); each gap it overlaps is ``send_cost`` s longer (what it takes from training). ``peer``: a
    peer with the same cadence sends to this node half a period later, at the same cost. The sender looks
    at the slots between its chunks and when idle. ``linger``: the gap after a send is that much longer too
    (caches and memory still shaken: what makes the gaps between sends not quite clean)."""
    rng = random.Random(seed)
    now, gen, left, after = 0.0, 1, 0, False
    for _ in range(gaps):
        if left == 0 and gen % c.every == 0 and not c.quiet:     # a send of the snapshot that just landed
            left = send_gaps
        receiving = peer and c.every > 1 and gen % c.every == c.every // 2
        length = step * (1 + rng.uniform(-noise, noise)) + (send_cost if left else 0.0) \
            + (send_cost if receiving else 0.0) + (linger if after and not left else 0.0)
        after = bool(left)
        c.look(now + length / 4, gen, bool(left), receiving)    # looks between chunks
        if left:
            left -= 1
            if left == 0:
                c.sent(now + length / 2, send_seconds)
        now += length
        gen += 1
        c.look(now, gen, False)


def test_sends_that_cost_nothing_go_with_every_snapshot():
    c = Cadence(budget=0.03)
    run(c, 200, step=0.1, send_cost=0.0)
    assert c.every == 1 and c.cost < 1e-9


def test_sends_that_slow_training_go_less_often_until_they_cost_the_budget():
    """A send makes the gap it overlaps 35 % longer: one every 12 snapshots costs 2.9 % on average."""
    c = Cadence(budget=0.03)
    run(c, 400, step=0.1, send_cost=0.035)
    assert c.cost is not None and abs(c.cost - 0.35) < 1e-6
    assert c.every == 12


def test_sends_as_long_as_the_steps_leave_gaps_to_compare_with():
    """Every gap overlapped: no clean gap tells the step time without replication, so the sender backs off
    until it has some, then judges the cost (two gaps per send, 20 % each: 0.4 gaps per send)."""
    c = Cadence(budget=0.03)
    run(c, 600, step=0.1, send_cost=0.02, send_gaps=2)
    assert c.every == 14 and abs(c.cost - 0.4) < 1e-6


def test_noisy_steps_never_throttle_sends_of_a_few_milliseconds():
    """Steps vary by ±30 % and a send takes 1 ms: whatever the noise makes of the overlapped gaps, a send
    cannot have cost more than it lasted, so every snapshot is still replicated."""
    for seed in range(20):
        c = Cadence(budget=0.03)
        run(c, 300, step=0.1, send_cost=0.0, send_seconds=0.001, noise=0.3, seed=seed)
        assert c.every == 1, (seed, c.cost)


def test_what_a_peers_sends_cost_this_node_is_charged_to_its_own_sends():
    """Every node sends as much as it receives: a peer's replica arriving here slows this node's steps as much
    as its own send does, so one send costs twice what its own gap shows (0.7 gaps): one every 24 (give or
    take what the edges of the windows hold at a few sends per window)."""
    c = Cadence(budget=0.03)
    run(c, 800, step=0.1, send_cost=0.035, peer=True)
    assert 18 <= c.every <= 30 and 0.5 <= c.cost <= 0.85, (c.every, c.cost)
    alone = Cadence(budget=0.03)
    run(alone, 800, step=0.1, send_cost=0.035)
    assert c.every > 1.5 * alone.every


def test_a_cost_that_outlasts_the_send_is_measured_against_quiet_periods():
    """A send makes its gap 35 % longer and the next one 17.5 %: comparing busy gaps with the gaps between
    them sees only the first (one every 12); the quiet periods, where nothing is sent for 12 gaps, show the
    step time without replication, and the whole cost, 0.525 gaps per send: one every 18."""
    c = Cadence(budget=0.03)
    run(c, 1600, step=0.1, send_cost=0.035, linger=0.0175)
    assert 17 <= c.every <= 19 and abs(c.cost - 0.525) < 0.03, (c.every, c.cost)


def test_never_fewer_than_one_replica_per_max_every_snapshots():
    c = Cadence(budget=0.03, max_every=8)
    run(c, 300, step=0.1, send_cost=0.5)
    assert c.every == 8
