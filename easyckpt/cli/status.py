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
    from easyckpt.engine.client import agent_status
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
                         world_size=done.header.world_size)
        snapshots.append(entry)
    committed = SaveDir(args.dir, naming).committed()
    newest = None
    if committed:
        step, path = committed[0]
        man = stepfiles.read(path)
        newest = {"step": step, "path": path, "bytes": man.nbytes if man is not None else 0,
                  "committed_at": storage_for(path).mtime(os.path.join(path, mf.MANIFEST_NAME))}
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
    tier = report["local_tier"]
    steps = sorted({c["step"] for c in tier["copies"]}, reverse=True)
    ranks = sorted({c["rank"] for c in tier["copies"]})
    say(f"local tier steps {steps} (ranks {ranks}, {human(sum(c['bytes'] for c in tier['copies']))})  {tier['dir']}"
        if steps else f"local tier none  {tier['dir']}")
    say(f"/dev/shm   {human(dev_shm['used'])} of {human(dev_shm['total'])} used, this job "
        f"{human(dev_shm['this_job'])}, {human(dev_shm['free'])} free")


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
