"""The loader's choice over its sources (engine/load/agree.py, sources.PRIORITY), on every rank's listings as
the ranks gather them: a mapping by source name, each step with its verdict (None: trusted)."""
from easyckpt.engine.load.agree import choose


def _rank(memory=(), peer=(), local=(), storage=(), adopted=(), planted=()):
    return {"memory": {s: None for s in memory}, "peer": {s: None for s in peer}, "local": {s: None for s in local},
            "storage": {s: ("owned by another user" if s in planted else None) for s in storage},
            "adopted": {s: None for s in adopted}}


def _plan(views, runs=None):
    return [(tier.names, steps) for tier, steps in choose(views, runs or {})]


def test_memory_wins_when_it_is_as_new_as_storage_and_the_tier():
    views = [_rank(memory=[30], local=[30], storage=[20, 30]), _rank(memory=[30], local=[30], storage=[20, 30])]
    assert _plan(views) == [(("memory", "peer"), [30]), (("local",), [30]), (("storage", "adopted"), [30, 20])]


def test_a_step_counts_as_in_memory_when_every_rank_has_it_on_its_node_or_on_a_peer():
    views = [_rank(memory=[40]), _rank(peer=[40]), _rank(memory=[40], peer=[30])]
    assert _plan(views)[0] == (("memory", "peer"), [40])


def test_memory_older_than_the_tier_or_storage_is_not_tried():
    views = [_rank(memory=[10], local=[20], storage=[30])]
    assert _plan(views) == [(("storage", "adopted"), [30])]
    views = [_rank(memory=[10], local=[20], storage=[15])]
    assert _plan(views) == [(("local",), [20]), (("storage", "adopted"), [15])]


def test_storage_and_adopted_steps_share_one_order_and_each_is_agreed_on_its_own():
    # 50 is stored on rank 0 only and adopted on rank 1 only: no rank-wide source holds it
    views = [_rank(storage=[20, 50], adopted=[40]), _rank(storage=[20], adopted=[40, 50])]
    assert _plan(views) == [(("storage", "adopted"), [40, 20])]


def test_the_walk_is_newest_commit_first_by_run_then_step():
    views = [_rank(storage=[100, 20])]
    assert _plan(views, {100: (1, 0.0), 20: (2, 0.0)}) == [(("storage", "adopted"), [20, 100])]


def test_a_planted_step_never_outranks_memory_and_is_still_tried_last_resort():
    views = [_rank(memory=[30], storage=[99999990, 20], planted=[99999990]), _rank(memory=[30], storage=[99999990, 20])]
    assert _plan(views) == [(("memory", "peer"), [30]), (("storage", "adopted"), [99999990, 20])]
