"""Simulated nodes on one machine: what a real host has of its own, made with Linux namespaces.

A cluster of N nodes is N + 1 network namespaces: a "switch" holding a bridge, and one per node joined to
it by a veth pair, with an address in a private subnet (``SUBNET``) that exists only inside them. A node
runs its processes in a fresh PID, mount and UTS namespace within its network namespace: its own
hostname, its own /dev/shm (a private tmpfs), its own abstract Unix sockets (they are per network
namespace, which is what makes two nodes' easyckpt agents distinct). Every node shares the host's file
system: the save directory and the checkout, as on a cluster with a shared file system.

Killing a node kills its PID namespace's first process: every trainer, the agent and the /dev/shm tmpfs
go together, as on a lost host. A replacement node is a fresh PID/mount namespace in the same network
namespace: the same address, an empty /dev/shm.

A link can be shaped for network-aware tests with ``tc`` on the node's end (``ip netns exec <node.ns> tc qdisc
add dev veth0 root tbf rate 1gbit burst 1mb latency 10ms``); nothing here does yet.

Needs root and ``ip``, ``unshare``, ``nsenter``; ``Cluster`` removes every namespace, veth, process and mount it made
on ``close()`` (the ``cluster`` fixture in test_many_nodes.py calls it in a ``finally``). Run as a script,
this module is a node's first process (``init``): it mounts the tmpfs, sets the hostname, runs the
node's command, records its exit status and reaps every process of the node (the agent outlives the
trainers, re-parented to it) before it leaves.
"""
from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

PREFIX = "eckn"                    # every network namespace this harness makes starts with it
SUBNET = "10.213.77"               # /24, used only inside the namespaces made here
SHM_SIZE = "256m"
IFNAME = "veth0"                   # the node's interface, in the node's namespace (GLOO_SOCKET_IFNAME)
CMD_TIMEOUT = 30                   # every ip/unshare call
_ports = itertools.count(29500)


def unavailable() -> Optional[str]:
    """Why simulated nodes cannot run here (None when they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "simulated nodes need root (network, PID and mount namespaces); run the tests as root"
    missing = [t for t in ("ip", "unshare", "nsenter", "mount") if shutil.which(t) is None]
    if missing:
        return f"simulated nodes need {' and '.join(missing)} (iproute2, util-linux)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=CMD_TIMEOUT)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def our_namespaces() -> List[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX + "-")]


def remove_namespace(ns: str) -> None:
    """Kill whatever still runs in ``ns``, then delete it (its veth ends and the bridge go with it)."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    _ip("netns", "del", ns, check=False)


def _children() -> Dict[int, List[int]]:
    from harness import children
    return children()


def _is_launcher(pid: int) -> bool:
    try:
        return b"torch.distributed.run" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class NodeRun:
    """One life of a node: a PID/mount/UTS namespace running ``cmd``."""

    def __init__(self, node: "Node", cmd: Sequence[str], env: Dict[str, str], log: Path):
        self.node, self.log = node, log
        self.rc_file = log.with_suffix(".rc")
        self.rc_file.unlink(missing_ok=True)
        self._out = open(log, "w")
        self._init: Optional[int] = None
        # ip netns exec execs unshare (no fork); unshare forks the node's init; --kill-child: if unshare
        # dies, so does the node
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", node.ns, "unshare", "--mount", "--uts", "--pid", "--fork", "--kill-child",
             "--mount-proc", "--propagation", "private",
             sys.executable, str(Path(__file__).resolve()), "init", node.hostname, str(self.rc_file), "--", *cmd],
            env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    def init_pid(self, timeout: float = 30) -> int:
        """The node's first process (pid 1 inside it), as the host sees it."""
        deadline = time.monotonic() + timeout
        while self._init is None:
            kids = _children().get(self.proc.pid, [])
            if kids:
                self._init = kids[0]
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"node {self.node.index} did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)
        return self._init

    def pids(self) -> List[int]:
        """Every process of the node but its init (host pids): those in its PID namespace, whoever started
        them (``enter`` starts them from outside)."""
        if self.proc.poll() is not None:
            return []
        init = self.init_pid()
        try:
            ns = os.readlink(f"/proc/{init}/ns/pid")
        except OSError:
            return []
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != init:
                try:
                    if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                        out.append(int(entry))
                except OSError:
                    pass
        return out

    def enter(self, cmd: Sequence[str], log: Path, extra_env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        """Run ``cmd`` in this life of the node (its /dev/shm, its agent), as a job restarted on the same
        host is; the Popen ends with the command."""
        with open(log, "w") as out:
            return subprocess.Popen(["nsenter", f"--target={self.init_pid()}", "--net", "--mount", "--uts", "--pid",
                                     "--", *cmd], env=self.node.env(extra_env), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def agents(self) -> List[int]:
        from harness import is_agent
        return [p for p in self.pids() if is_agent(p)]

    def signal(self, sig: int, launcher: bool = True) -> List[int]:
        """``sig`` to every process of the node at once, as a host's shutdown or a scheduler does (the init
        is left out: it is the namespace, not a process of the job); ``launcher=False`` spares torchrun,
        which exits 1 on a signal whatever its workers did and leaves the other nodes' torchrun waiting
        in their exit barrier (300 s)."""
        from harness import kill_all
        return kill_all([p for p in self.pids() if launcher or not _is_launcher(p)], sig)

    def trainers(self) -> Dict[int, int]:
        """Global rank -> pid of the node's trainers (the processes torchrun gave a RANK)."""
        from harness import is_agent
        found = {}
        for pid in self.pids():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            rank = [e[5:] for e in environ if e.startswith(b"RANK=")]
            if rank and b"torch.distributed.run" not in cmdline and not is_agent(pid):
                found[int(rank[0])] = pid
        return found

    def kill_trainers(self) -> None:
        """kill -9 every process of the node at once but the agent (which survives, as a node agent does)."""
        from harness import is_agent
        for pid in [p for p in self.pids() if not is_agent(p)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """The node is lost: its init dies, and with it every process, the agent and the /dev/shm tmpfs."""
        if self.proc.poll() is None:
            try:
                os.kill(self.init_pid(), signal.SIGKILL)
            except (ProcessLookupError, AssertionError):
                self.proc.kill()
        self.wait(30)

    def command_rc(self) -> Optional[int]:
        """The exit status of the node's command (torchrun), once it has exited (the agent may still run)."""
        try:
            return int(self.rc_file.read_text())
        except (OSError, ValueError):
            return None

    def wait_command(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (rc := self.command_rc()) is None:
            if self.proc.poll() is not None:
                return self.proc.returncode
            if time.monotonic() > deadline:
                raise AssertionError(f"node {self.node.index}'s command still runs after {timeout}s:\n"
                                     f"{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        return rc

    def wait(self, timeout: float) -> int:
        """Until every process of the node has exited (the agent too); the command's exit status."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {self.node.index} still has processes after {timeout}s: {self.pids()}\n"
                                 f"{self.log.read_text()[-3000:]}") from None
        finally:
            if self.proc.poll() is not None and not self._out.closed:
                self._out.close()
        rc = self.command_rc()
        return self.proc.returncode if rc is None else rc

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


class Node:
    def __init__(self, cluster: "Cluster", index: int):
        self.cluster, self.index = cluster, index
        self.ns = f"{cluster.name}-n{index}"
        self.addr = f"{SUBNET}.{index + 1}"
        self.hostname = f"node{index}"
        self.runs: List[NodeRun] = []

    @property
    def current(self) -> NodeRun:
        return self.runs[-1]

    def launch(self, cmd: Sequence[str], log: Path, extra_env: Optional[Dict[str, str]] = None) -> NodeRun:
        """Start ``cmd`` on a fresh instance of this node (a new PID/mount namespace, an empty /dev/shm)."""
        if self.runs and self.current.proc.poll() is None:
            raise AssertionError(f"node {self.index} still runs; kill it or wait for it first")
        self.runs.append(NodeRun(self, cmd, self.env(extra_env), log))
        return self.current

    def env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        from harness import env
        return env({"GLOO_SOCKET_IFNAME": IFNAME, "EASYCKPT_SHM_DIR": "/dev/shm", **(extra or {})})


class Cluster:
    """N simulated nodes on a bridge; ``close()`` removes all of it."""

    def __init__(self, n: int, workdir: Path):
        self.name = f"{PREFIX}-{os.getpid()}-{next(_ids)}"
        self.workdir = workdir
        self.nodes: List[Node] = []
        self._made: List[str] = []
        try:
            self.switch = f"{self.name}-sw"
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i in range(n):
                node = Node(self, i)
                self._add_ns(node.ns)
                _ip("link", "add", IFNAME, "netns", node.ns, "type", "veth", "peer", "name", f"port{i}",
                    "netns", self.switch)
                _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"port{i}", "up")
                _ip("-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", IFNAME)
                _ip("-n", node.ns, "link", "set", IFNAME, "up")
                _ip("-n", node.ns, "link", "set", "lo", "up")
                self.nodes.append(node)
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def train_cmds(self, save_dir: Path, nproc: int, *args: str, only: Optional[int] = None,
                   script: Optional[Path] = None, save_flag: str = "--save-dir") -> List[List[str]]:
        """Per node, torchrun of tests/worker_pytorch.py (or ``script``, given the save dir as ``save_flag``) as one
        node of ``len(nodes)`` (static rendezvous on node 0's address, a fresh port per launch); ``only``: a job of
        the first ``only`` nodes alone (a job restarted on fewer nodes)."""
        from harness import TRAIN
        port = next(_ports)
        used = self.nodes[:only] if only is not None else self.nodes
        return [[sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(used)}",
                 f"--node_rank={node.index}", f"--nproc_per_node={nproc}", f"--master_addr={self.nodes[0].addr}",
                 f"--master_port={port}", str(script or TRAIN), save_flag, str(save_dir), *args] for node in used]

    def launch(self, save_dir: Path, nproc: int, *args: str, tag: str = "run",
               node_env: Optional[Dict[int, Dict[str, str]]] = None,
               node_args: Optional[Dict[int, Sequence[str]]] = None, script: Optional[Path] = None) -> List[NodeRun]:
        """The job on a fresh instance of every node: ``nproc`` ranks each, global rank = node × nproc +
        local rank; ``node_env`` / ``node_args``: what only node i gets; ``script``: train_cmds'."""
        return [node.launch([*cmd, *(node_args or {}).get(node.index, ())], self.log(tag, node.index),
                            (node_env or {}).get(node.index))
                for node, cmd in zip(self.nodes, self.train_cmds(save_dir, nproc, *args, script=script))]

    def relaunch(self, save_dir: Path, nproc: int, *args: str, tag: str = "relaunch") -> List[subprocess.Popen]:
        """The job restarted on the nodes' current lives (their agents and /dev/shm as they are)."""
        return [node.current.enter(cmd, self.log(tag, node.index))
                for node, cmd in zip(self.nodes, self.train_cmds(save_dir, nproc, *args))]

    def log(self, tag: str, index: int) -> Path:
        return self.workdir / f"{tag}.node{index}.out"

    def wait(self, runs: Sequence[NodeRun], timeout: float) -> List[int]:
        """Every node's exit status once all its processes are gone; an error naming what a failed node said."""
        deadline = time.monotonic() + timeout
        return [r.wait(max(1.0, deadline - time.monotonic())) for r in runs]

    def close(self) -> None:
        for node in self.nodes:
            for r in node.runs:
                if r.proc.poll() is None:
                    r.kill()
                if not r._out.closed:
                    r._out.close()
        for ns in reversed(self._made):
            remove_namespace(ns)
        self._made.clear()


_ids = itertools.count()


def _init(hostname: str, rc_file: str, cmd: List[str]) -> int:
    """The node's pid 1: its /dev/shm, its hostname, its command; reaps every process of the node."""
    import socket
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SHM_SIZE},mode=1777", "tmpfs", "/dev/shm"], check=True,
                   timeout=CMD_TIMEOUT)
    socket.sethostname(hostname)
    child = subprocess.Popen(cmd)
    rc = 1
    # until pid 1 is alone: when it exits, the kernel kills what is left of the node, and a process that
    # ``enter`` started is not its child
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pid = 0
            if not [p for p in os.listdir("/proc") if p.isdigit() and p != "1"]:
                break
        if pid == child.pid:
            rc = os.waitstatus_to_exitcode(status)
            Path(rc_file).write_text(str(rc))
        if not pid:
            time.sleep(0.05)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__" and sys.argv[1:2] == ["init"]:
    sys.exit(_init(sys.argv[2], sys.argv[3], sys.argv[sys.argv.index("--") + 1:]))
