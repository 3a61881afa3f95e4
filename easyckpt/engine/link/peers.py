"""Peer replicas, the trainers' part: introduce the nodes' agents to each other through the job's c10d store,
and ask the node's agent for a rank's state held on peers (agent/replicas.py does the rest).

Once per run, at the first load or snapshot (both are reached by every rank together): local rank 0 of
each node asks its agent to listen on this node's address (the one that reaches the rendezvous host)
and publishes ``address@port`` under the job's key in the store; every rank waits (agent_start_timeout at
most) for every node's entry, hands the table to its agent, and waits until every rank has (a peer asked
with the new run's secret before its agent holds it would refuse the handshake). Key names carry the job
id; torchrun gives every restart of the job a store prefix of its own, so a restarted job never reads the
last run's table.

The replica secret never goes into the store (docs/reliability.md promise 14): the c10d store has no authentication, and
anyone who reaches its port could read it and then fetch or plant replicas. Global rank 0 makes it and it
reaches the other ranks in a collective of the job's process group (``job_secret``); or the operator gives
every node a file (EASYCKPT_REPLICA_SECRET_FILE: a regular file of the job's user, mode 0600 or 0400), and
the secret is derived from it and the job id. Endpoints may stay in the store: a forged one gains nothing,
as the handshake needs the secret on both sides.

Replicas are off (a console line says why) for one node, replication_factor=1, without a process group,
or when ranks are not numbered node by node as torchrun numbers them.
"""
from __future__ import annotations

import collections
import hashlib
import math
import os
import secrets
import socket
import stat
import time
from datetime import timedelta
from typing import Any, List, Optional, Tuple

from easyckpt import _faults as faults
from easyckpt import console
from easyckpt.config import Config
from easyckpt.engine.link.dist import all_gather
from easyckpt.engine.seams import AgentLink
from easyckpt.errors import AgentError, ConfigError
from easyckpt.formats import paths, protocol
from easyckpt.formats.replies import (
    ListenReply,
    PeersReply,
    ReplicaFetchReply,
    ReplicaListReply,
)
from easyckpt.storage.auditlog import AuditLog

SECRET_FILE_ENV = "EASYCKPT_REPLICA_SECRET_FILE"
MAX_SECRET_FILE = 4096
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

    def __init__(self, client: AgentLink, rank: int):
        self.client, self.rank = client, rank

    def steps(self) -> List[Tuple[int, int, int]]:
        """(step, world_size, node) of every replica of this rank that a peer holds; none when the agent
        cannot say (the load then goes on without peers: it must never fail for want of a replica)."""
        try:
            reply = self.client.request(protocol.ReplicaList(self.rank), ReplicaListReply, FETCH_TIMEOUT)
        except (AgentError, OSError) as exc:
            console.warning(f"rank {self.rank}: could not ask for replicas on peer nodes ({exc}); "
                            f"resuming without them")
            return []
        if not reply.ok:
            console.warning(f"rank {self.rank}: its agent could not ask peer nodes for replicas ({reply.error}); "
                            f"resuming without them")
            return []
        if reply.problems:      # a holder that did not answer: its replicas are not counted, and that is said
            console.warning(f"rank {self.rank}: replica holder(s) not asked: {'; '.join(reply.problems)}")
        return list(reply.steps)

    def fetch(self, step: int) -> ReplicaFetchReply:
        """Pull ``step`` into this rank's own slot on this node (the reply names the slot, bytes, node)."""
        reply = self.client.request(protocol.ReplicaFetch(self.rank, step), ReplicaFetchReply, FETCH_TIMEOUT)
        if not reply.ok or reply.slot is None:
            raise AgentError(f"rank {self.rank}: step {step} could not be pulled from a peer: {reply.error}")
        return reply


def introduce(cfg: Config, client: AgentLink, rank: int, world_size: int, local_rank: int,
              log: AuditLog) -> Optional[Remote]:
    """Exchange the agents' endpoints through the store; the Remote of this rank, or None when off."""
    where = layout(world_size, rank)
    if cfg.replication_factor < 2 or where is None:
        return None
    node, nnodes, per_node = where
    store = _store()
    if store is None:
        _off(rank, log, "no torch.distributed process group (its store is how the agents find each other)")
        return None
    try:
        secret = job_secret(cfg.job_id, rank, world_size)      # a collective: every rank, before any may leave
    except Exception as exc:  # noqa: BLE001 - replicas are an extra copy: without them training goes on
        _off(rank, log, f"no replica secret ({type(exc).__name__}: {exc})")
        return None
    if rank // per_node != node:
        _off(rank, log, f"rank {rank} is on node {node}, not numbered node by node ({per_node} ranks per node)")
        return None
    prefix = f"easyckpt/{cfg.job_id}/"
    deadline = time.monotonic() + cfg.agent_start_timeout     # one bound for the whole introduction, as said
    try:
        if local_rank == 0:
            addr = local_address()
            listening = client.request(protocol.Listen(addr), ListenReply, _left(deadline))
            if not listening.ok or listening.port is None:
                raise AgentError(str(listening.error))
            store.set(f"{prefix}agent{node}", f"{addr}@{listening.port}")
        keys = [f"{prefix}agent{i}" for i in range(nnodes)]
        store.wait(keys, timedelta(seconds=_left(deadline)))
        endpoints = ",".join(f"{i}={store.get(k).decode()}" for i, k in enumerate(keys))
        faults.inject("trainer.before_peers", rank)
        told = client.request(protocol.Peers(node, nnodes, per_node, secret, endpoints), PeersReply,
                              _left(deadline))
        if not told.ok:
            raise AgentError(str(told.error))
    except Exception as exc:  # noqa: BLE001 - replicas are an extra copy: without them training goes on
        _all_told(store, prefix, world_size, _left(deadline))
        _off(rank, log, f"the nodes' agents could not be introduced within agent_start_timeout="
                        f"{cfg.agent_start_timeout:g}s ({type(exc).__name__}: {exc})")
        return None
    if not _all_told(store, prefix, world_size, _left(deadline)):
        _off(rank, log, f"not every rank told its agent the replica table within agent_start_timeout="
                        f"{cfg.agent_start_timeout:g}s")
        return None
    log.emit("replicas", rank=rank, node=node, nnodes=nnodes, factor=cfg.replication_factor,
             jump=cfg.replication_jump, endpoints=endpoints)
    return Remote(client, rank)


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _all_told(store: Any, prefix: str, world_size: int, timeout: float) -> bool:
    """Wait (``timeout`` at most) until every rank has told its agent this run's table, or failed to. Each run
    has a secret of its own: a peer asked before its agent holds the new one refuses the handshake, so a rank
    that asked for its replicas at once found none on a node whose trainer was a moment later."""
    try:
        told = int(store.add(f"{prefix}told", 1))
        done = f"{prefix}all_told{(told - 1) // world_size}"   # a second introduction in one store: its own key
        if told % world_size == 0:
            store.set(done, "1")
        store.wait([done], timedelta(seconds=timeout))
        return True
    except Exception:  # noqa: BLE001 - the store's timeout (or its loss): replicas go off, training goes on
        return False


def job_secret(job_id: str, rank: int, world_size: int) -> str:
    """The replicas' secret, 64 hex digits, the same on every rank: from the operator's file when global rank
    0 has one (every node must), else rank 0's random choice; either way sent among the job's ranks over
    the process group, never through the store. A collective: every rank calls it."""
    path = os.environ.get(SECRET_FILE_ENV)
    offer = (("file", None) if path else ("made", secrets.token_hex(32))) if rank == 0 else None
    kind, made = all_gather(offer, world_size)[0]
    if kind == "made":
        return str(made)
    if not path:
        raise ConfigError(f"global rank 0 takes the replica secret from {SECRET_FILE_ENV}, which is not set on "
                          f"rank {rank}'s node: set it on every node")
    return secret_from_file(path, job_id)


MIN_SECRET_BITS = 32      # 16 random hex digits carry about 50: refused are only the plainly guessable ("a" * 16)


def _entropy_bits(raw: bytes) -> float:
    """The file's length times the Shannon entropy of its bytes: a crude bound that a repeated byte or a short
    repeated pattern cannot pass and random data always does."""
    counts = collections.Counter(raw)
    return -sum(n * math.log2(n / len(raw)) for n in counts.values())


def secret_from_file(path: str, job_id: str) -> str:
    """The secret derived from an operator's file (16 to MAX_SECRET_FILE bytes of random data) and the job:
    the file must be a regular file of this user, readable by nobody else (0600 or 0400), never a symlink."""
    try:
        fd = paths.open_regular(path, max_bytes=MAX_SECRET_FILE)
    except OSError as exc:
        raise ConfigError(f"{SECRET_FILE_ENV}={path}: {exc}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) not in (0o600, 0o400):
            raise ConfigError(f"{SECRET_FILE_ENV}={path} is owned by {paths.owner_name(st.st_uid)} with mode "
                              f"{stat.filemode(st.st_mode)}: it must be this user's (uid {os.geteuid()}), mode 0600 "
                              f"or 0400 (chmod 600 {path})")
        raw = os.read(fd, MAX_SECRET_FILE + 1).strip()
    finally:
        os.close(fd)
    fix = (f"give it 16 to {MAX_SECRET_FILE} bytes of random data (e.g. `openssl rand -hex 32 > {path}; "
           f"chmod 600 {path}`)")
    if len(raw) < 16:
        raise ConfigError(f"{SECRET_FILE_ENV}={path} holds {len(raw)} bytes besides leading and trailing whitespace: "
                          f"{fix}")
    if _entropy_bits(raw) < MIN_SECRET_BITS:
        raise ConfigError(f"{SECRET_FILE_ENV}={path} holds {len(raw)} bytes but only {len(set(raw))} distinct ones "
                          f"(about {_entropy_bits(raw):.0f} bits): anyone could guess it; {fix}")
    return hashlib.sha256(b"easyckpt replica secret\0" + job_id.encode() + b"\0" + raw).hexdigest()


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
