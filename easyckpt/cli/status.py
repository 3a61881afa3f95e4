"""``easyckpt status DIR``: this node's view of a job: its agent, its snapshots in memory and their replicas,
its local tier, the newest committed checkpoint, /dev/shm."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional

from easyckpt.cli import catalog
from easyckpt.cli.saying import say
from easyckpt.config import Config
from easyckpt.formats import manifest as mf
from easyckpt.formats import tier as tf
from easyckpt.formats.replies import ReplicaStatus, StatusReply
from easyckpt.storage import stepfiles, tierfiles
from easyckpt.storage.resolve import storage_for
from easyckpt.storage.savedir import SaveDir
from easyckpt.units import human


def cmd_status(args: argparse.Namespace) -> int:
    from easyckpt.engine.link.client import agent_status
    from easyckpt.ipc import shm, slotread
    cat = catalog.scan(args.dir, args.framework)
    job_id = Config(save_dir=args.dir, job_name=args.job_name).job_id
    framework, naming = cat.framework, catalog.naming(cat.framework)
    agent = agent_status(job_id)
    snapshots: List[Dict[str, Any]] = []
    for path, _job, rank, index, replica in shm.list_segments(job_id):
        entry = {"rank": rank, "slot": index, "path": path, "segment_bytes": os.path.getsize(path),
                 "step": None, "bytes": None, "complete": False, "replica": replica}
        try:
            done = slotread.read_complete(path)
        except OSError:
            continue
        if done is not None:
            entry.update(step=done.step, bytes=done.header.data_capacity, complete=True,
                         world_size=done.header.world_size, budget=_budget(done.meta.info))
        snapshots.append(entry)
    committed = SaveDir(args.dir, naming).committed()
    newest = None
    if committed:
        step, path = committed[0]
        man = stepfiles.read(path)
        newest = {"step": step, "path": path, "bytes": man.nbytes if man is not None else 0,
                  "committed_at": storage_for(path).mtime(os.path.join(path, mf.MANIFEST_NAME)),
                  "budget": _budget(man.info) if man is not None else None}
    st = os.statvfs(shm.SHM_DIR)
    dev_shm = {"total": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize,
               "used": (st.f_blocks - st.f_bfree) * st.f_frsize,
               "this_job": sum(s["segment_bytes"] for s in snapshots)}
    report = {"save_dir": args.dir, "job_id": job_id, "framework": framework,
              "agent": agent.to_wire() if agent is not None else None,
              "snapshots": snapshots, "newest_committed": newest, "committed_count": len(committed),
              "dev_shm": dev_shm, "local_tier": _local_tier(Config(save_dir=args.dir, job_name=args.job_name,
                                                                   local_dir=args.local_dir))}
    if args.json:
        say(json.dumps(report, indent=1))
        return 0
    _say_status(report, agent)
    return 0


def _say_status(report: Dict[str, Any], agent: Optional[StatusReply]) -> None:
    snapshots, newest, dev_shm = report["snapshots"], report["newest_committed"], report["dev_shm"]
    say(f"save dir   {report['save_dir']}  (job {report['job_id']}, {report['framework']} layout)")
    if agent is None:
        say("agent      not running on this node")
    else:
        say(f"agent      pid {agent.agent_pid}, ranks attached {agent.connected}, dead {agent.dead_ranks}, "
            f"pending commits {agent.pending_commits}, jobs queued {agent.outstanding}")
        if agent.sigterm is not None:
            say(f"           SIGTERM {agent.to_wire()['sigterm']}")
        if agent.last_error:
            say(f"           last error: {agent.last_error}")
        for text in agent.last_notices:      # what rank 0's console was told (its save dir replaced, ...)
            say(f"           said: {text}")
    if not snapshots:
        say("memory     no snapshot of this job on this node")
    for s in sorted(snapshots, key=lambda s: (s["replica"], s["rank"], s["slot"])):
        what = f"step {s['step']:>8}  {s['bytes']:>14,d} B" if s["complete"] else "(being written or torn)"
        kind = "replica    rank" if s["replica"] else "memory     rank"     # a replica: another node's rank, held here
        say(f"{kind} {s['rank']:>4} slot {s['slot']}  {what}")
    _say_replicas(agent.replicas if agent is not None else None)
    if newest is None:
        say("storage    no committed checkpoint")
    else:
        say(f"storage    newest committed step {newest['step']} ({newest['bytes']:,d} B, "
            f"{report['committed_count']} kept)  {newest['path']}")
    _say_cadence(snapshots, newest)
    tier = report["local_tier"]
    steps = sorted({c["step"] for c in tier["copies"]}, reverse=True)
    ranks = sorted({c["rank"] for c in tier["copies"]})
    say(f"local tier steps {steps} (ranks {ranks}, {human(sum(c['bytes'] for c in tier['copies']))})  {tier['dir']}"
        if steps else f"local tier none  {tier['dir']}")
    say(f"/dev/shm   {human(dev_shm['used'])} of {human(dev_shm['total'])} used, this job "
        f"{human(dev_shm['this_job'])}, {human(dev_shm['free'])} free")


def _budget(info: Any) -> Optional[Dict[str, Any]]:
    """The snapshot cadence a trainer recorded with its snapshot (engine/save/budget.py), checked field by field:
    a slot or a manifest may have been written by anyone."""
    got = info.get("budget") if isinstance(info, dict) else None
    if not isinstance(got, dict):
        return None
    numbers = {k: got.get(k) for k in ("every", "cost", "step_seconds", "per_step", "overhead", "bound")}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e12 for v in numbers.values()):
        return None
    budget = got.get("budget")
    numbers["budget"] = budget if isinstance(budget, (int, float)) and not isinstance(budget, bool) else None
    persist = got.get("persist_every")
    numbers["persist_every"] = persist if isinstance(persist, int) and not isinstance(persist, bool) and \
        0 < persist < 1e12 else None
    numbers["persist_paced"] = got.get("persist_paced") is True
    return numbers


def _say_cadence(snapshots: List[Dict[str, Any]], newest: Optional[Dict[str, Any]]) -> None:
    """How often rank 0 snapshots, what each snapshot costs the training loop and what a crash loses: from its
    newest snapshot in memory, else from the newest committed step."""
    own = [s for s in snapshots if s["complete"] and not s["replica"] and s["rank"] == 0 and s.get("budget")]
    got = max(own, key=lambda s: s["step"])["budget"] if own else (newest or {}).get("budget")
    if not got:
        return
    limit = f"max_overhead {got['budget']:g}" if got["budget"] is not None else "no max_overhead"
    measured = (f"each costs {got['cost'] * 1e3:.2f} ms of a {got['step_seconds'] * 1e3:.2f} ms step, "
                f"{got['per_step'] * 1e3:.3f} ms per step ({got['overhead']:.1%})" if got["step_seconds"]
                else "cost not measured yet")
    say(f"snapshots  every {int(got['every'])} step(s) ({limit}): {measured}; a crash loses at most "
        f"{int(got['bound'])} step(s)")
    if got.get("persist_every"):
        how = ("save_storage_interval left at its default: spaced so that the agent's writing stays within half "
               "of max_overhead" if got.get("persist_paced") else "save_storage_interval")
        say(f"persists   every {got['persist_every']} step(s) ({how})")


def _say_replicas(rep: Optional[ReplicaStatus]) -> None:
    """Where this node's snapshot is replicated, and whose replicas it holds (the agent's view)."""
    if rep is None or rep.node is None:
        say("replicas   none: one node, replication_factor=1, or no trainer has introduced the agents yet")
        return
    say(f"replicas   this is node {rep.node} of {rep.nnodes} (replication_factor {rep.factor}), "
        f"listening on {rep.listening}")
    if rep.every > 1:
        say(f"           sending every {rep.every}th snapshot (what training can spare, measured by the agent)")
    for node, where in sorted(rep.targets.items()):
        sent = rep.sent.get(node)
        got = (f"holds step {sent.step} ({human(sent.bytes)}, sent in {sent.seconds:.2f} s)" if sent
               else "holds nothing yet")
        say(f"           own snapshot -> node {node} at {where}: {got}")
    for h in rep.holds:
        say(f"           holds rank {h.rank} of node {h.from_node}: step {h.step} ({human(h.bytes)})")
    for node, why in sorted(rep.starved.items()):
        say(f"           STARVED node {node}: {why}")
    for err in rep.errors:
        say(f"           {err}")


def _local_tier(cfg: Config) -> Dict[str, Any]:
    """The complete copies in this node's local tier (of every rank found there), each checked against its
    record's size (not its checksum: `easyckpt status` reads no snapshot whole)."""
    where = tierfiles.directory(cfg.node_dir, cfg.job_id)
    try:
        names = os.listdir(where)
    except OSError:
        names = []
    ranks = sorted({p[1] for p in map(tf.parse_name, names) if p is not None})
    copies = [{"step": c.step, "rank": rank, "bytes": c.record.size, "path": c.path}
              for rank in ranks for c in tierfiles.listing(where, cfg.job_id, rank)]
    return {"dir": where, "copies": copies}
