"""Peer replicas, the trainers' part: introduce the nodes' agents to each other through the job's c10d store,
and ask the node's agent for a rank's state held on peers (agent/replicas.py does the rest).

Once per run, at the first load or snapshot (both are reached by every rank together): local rank 0 of
each node asks its agent to listen on this node's address (the one that reaches the rendezvous host)
and publishes ``address@port`` under the job's key in the store; global rank 0 publishes a fresh random
secret; every rank waits (agent_start_timeout at most) for every node's entry and hands the table to its
agent. Key names carry the job id; torchrun gives every restart of the job a store prefix of its own, so
a restarted job never reads the last run's table.

Replicas are off (a console line says why) for one node, replication_factor=1, without a process group,
or when ranks are not numbered node by node as torchrun numbers them.
"""
from __future__ import annotations

import os
import secrets
import socket
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

from easyckpt import console
from easyckpt.config import Config
from easyckpt.errors import AgentError
from easyckpt.storage.auditlog import AuditLog
from easyckpt.trainer.client import AgentClient

FETCH_TIMEOUT = 600.0     # a pull of a rank's state: the transfer's own reads time out after 30 s of silence


def layout(world_size: int, rank: int) -> Optional[Tuple[int, int, int]]:
    """(node, nnodes, ranks_per_node) as torchrun numbers them, or None when this is one node."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if per_node < 1 or world_size % per_node or world_size == per_node:
        return None
    node = int(os.environ.get("GROUP_RANK", str(rank // per_node)))
    return node, world_size // per_node, per_node


def replica_copies(cfg: Config, world_size: int, rank: int) -> int:
    """How many other nodes' snapshots this node holds as replicas (for the /dev/shm capacity check)."""
    where = layout(world_size, rank)
    return 0 if where is None else min(cfg.replication_factor - 1, where[1] - 1)


def local_address() -> str:
    """This node's address as its peers reach it: EASYCKPT_REPLICA_ADDR, else the source address of the
    route to the rendezvous host (MASTER_ADDR), which is on the network the job already uses."""
    explicit = os.environ.get("EASYCKPT_REPLICA_ADDR")
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR") or socket.gethostname()
    port = int(os.environ.get("MASTER_PORT", "29500") or 29500)
    family, kind, _, _, sockaddr = socket.getaddrinfo(master, port, type=socket.SOCK_DGRAM)[0]
    probe = socket.socket(family, kind)
    try:
        probe.connect(sockaddr)        # UDP: no packet is sent, the kernel only picks the route
        return str(probe.getsockname()[0])
    finally:
        probe.close()


class Remote:
    """This rank's view of its state held on peers: the steps, and a pull into its own slot."""

    def __init__(self, client: AgentClient, rank: int):
        self.client, self.rank = client, rank

    def steps(self) -> List[Tuple[int, int, int]]:
        """(step, world_size, node) of every replica of this rank that a peer holds; none when the agent
        cannot say (the load then goes on without peers: it must never fail for want of a replica)."""
        try:
            reply = self.client.request({"op": "replica_list", "rank": self.rank}, FETCH_TIMEOUT)
        except (AgentError, OSError) as exc:
            console.warning(f"rank {self.rank}: could not ask for replicas on peer nodes ({exc}); "
                            f"resuming without them")
            return []
        steps = reply.get("steps") if reply.get("ok") is True else None
        if not isinstance(steps, list):
            return []
        return [(s[0], s[1], s[2]) for s in steps
                if isinstance(s, list) and len(s) == 3 and all(type(x) is int and x >= 0 for x in s)]

    def fetch(self, step: int) -> Dict[str, Any]:
        """Pull ``step`` into this rank's own slot on this node: {slot, bytes, seconds, node}."""
        reply = self.client.request({"op": "replica_fetch", "rank": self.rank, "step": step}, FETCH_TIMEOUT)
        if reply.get("ok") is not True:
            raise AgentError(f"rank {self.rank}: step {step} could not be pulled from a peer: {reply.get('error')}")
        return reply


def introduce(cfg: Config, client: AgentClient, rank: int, world_size: int, local_rank: int,
              log: AuditLog) -> Optional[Remote]:
    """Exchange the agents' endpoints through the store; the Remote of this rank, or None when off."""
    where = layout(world_size, rank)
    if cfg.replication_factor < 2 or where is None:
        return None
    node, nnodes, per_node = where
    if rank // per_node != node:
        _off(rank, log, f"rank {rank} is on node {node}, not numbered node by node ({per_node} ranks per node)")
        return None
    store = _store()
    if store is None:
        _off(rank, log, "no torch.distributed process group (its store is how the agents find each other)")
        return None
    prefix = f"easyckpt/{cfg.job_id}/"
    try:
        if local_rank == 0:
            addr = local_address()
            reply = client.request({"op": "listen", "addr": addr}, cfg.agent_start_timeout)
            if reply.get("ok") is not True:
                raise AgentError(str(reply.get("error")))
            store.set(f"{prefix}agent{node}", f"{addr}@{reply['port']}")
        if rank == 0:
            store.set(f"{prefix}secret", secrets.token_hex(32))
        keys = [f"{prefix}agent{i}" for i in range(nnodes)] + [f"{prefix}secret"]
        store.wait(keys, timedelta(seconds=cfg.agent_start_timeout))
        endpoints = ",".join(f"{i}={store.get(k).decode()}" for i, k in enumerate(keys[:-1]))
        secret = store.get(keys[-1]).decode()
        reply = client.request({"op": "peers", "node": node, "nnodes": nnodes, "ranks_per_node": per_node,
                                "secret": secret, "endpoints": endpoints}, cfg.agent_start_timeout)
        if reply.get("ok") is not True:
            raise AgentError(str(reply.get("error")))
    except Exception as exc:  # noqa: BLE001 - replicas are an extra copy: without them training goes on
        _off(rank, log, f"the nodes' agents could not be introduced within agent_start_timeout="
                        f"{cfg.agent_start_timeout:g}s ({type(exc).__name__}: {exc})")
        return None
    log.emit("replicas", rank=rank, node=node, nnodes=nnodes, factor=cfg.replication_factor,
             jump=cfg.replication_jump, endpoints=endpoints)
    return Remote(client, rank)


def _store() -> Any:
    try:
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            return None
        return dist.distributed_c10d._get_default_store()
    except (ImportError, RuntimeError, AttributeError):
        return None


def _off(rank: int, log: AuditLog, why: str) -> None:
    log.record("warning", rank=rank, message=f"peer replicas are off for this run: {why}")
    if rank == 0:
        console.warning(f"peer replicas are off for this run: {why}")
