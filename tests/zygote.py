"""A fork server for the Python processes the tests start: ``zygote.py SOCKET MODULE...`` imports the third-party
MODULEs once (torch, the Trainer, megatron-core), then forks one child per request, which runs a script as
``__main__`` as ``python SCRIPT ARGS...`` would. A test run costs no interpreter start and no torch import (1.5
CPU-seconds here; the Trainer's 4.6, megatron-core's 4.1). harness.run and harness.start send it the commands it
can start (harness.forkable); each pytest-xdist worker has its own servers, ended with it.

The child starts as an exec'd process would: its own environment, working directory, standard streams (passed
over the socket) and session; default signal dispositions (Python's SIGINT handler); no parent-death signal;
``sys.argv``, ``sys.path[0]`` and ``__main__`` of its script; its exit handlers run at its end, after its
threads. Its name (``/proc/PID/comm``) says what it is, as its command line is the server's: ``launcher`` for
tests/warm_torchrun.py (whose workers name themselves ``rankN``), ``trainer`` for a script (harness.trainer_rank).
easyckpt is never imported by the server: its modules read EASYCKPT_* variables at import, which a test may set.

Protocol, per connection: the client sends an 8-byte length with its stdin, stdout and stderr descriptors
(SCM_RIGHTS), then that many bytes of JSON ``{"argv", "env", "cwd", "session"}``; the server answers
``PID\\n``, then ``STATUS\\n`` when the child ended (as Popen.returncode: ``-N`` for signal N).
"""
from __future__ import annotations

import atexit
import ctypes
import faulthandler
import importlib
import json
import os
import runpy
import select
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Callable, Dict, List, Optional, Sequence

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
_HEADER = struct.Struct("!Q")
SETTLE = 3.0        # seconds run() reads on after on_timeout: stacks asked for by a signal come at once


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the client left mid-request")
        data += chunk
    return data


def _request(conn: socket.socket) -> tuple:
    head, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 3)
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"expected 3 descriptors, got {len(fds)}")
    try:
        head += _recv_exact(conn, _HEADER.size - len(head))
        size = _HEADER.unpack(head)[0]
        if size > MAX_REQUEST:
            raise ValueError(f"a request of {size} bytes (at most {MAX_REQUEST})")
        req = json.loads(_recv_exact(conn, size))
        _check(req)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return req, fds


MAX_REQUEST = 1 << 20


def _check(req: object) -> None:
    """Every field of a request, checked before the fork: a child must only ever run a script."""
    if not (isinstance(req, dict) and set(req) == {"argv", "env", "cwd", "session"}):
        raise ValueError(f"not a request: {str(req)[:200]}")
    argv, env = req["argv"], req["env"]
    if not (isinstance(argv, list) and len(argv) >= 2 and all(isinstance(a, str) for a in argv)
            and argv[1].endswith(".py")):
        raise ValueError(f"argv must be [python, SCRIPT.py, ARGS...]: {argv!r}"[:300])
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env must map names to strings")
    if not (isinstance(req["cwd"], str) and os.path.isabs(req["cwd"]) and isinstance(req["session"], bool)):
        raise ValueError(f"cwd must be an absolute path and session a bool: {req['cwd']!r}, {req['session']!r}")


def _child(req: dict, fds: List[int], inherited: List[int]) -> None:
    """In the forked child: become ``python SCRIPT ARGS`` started by exec, run it, exit with its status."""
    for fd in inherited:
        os.close(fd)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if req["session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()       # as an interpreter started with it: stacks on SIGABRT (tests/hangs.py)
    else:
        faulthandler.disable()
    script = req["argv"][1]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0)
    name = b"launcher" if script.endswith("warm_torchrun.py") else b"trainer"
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    sys.argv = req["argv"][1:]
    os._exit(run_as_main(script) & 0xFF)


def run_as_main(script: str) -> int:
    """Run ``script`` (``sys.argv`` already its own) as ``__main__`` with its directory first on ``sys.path``, to
    its end as an interpreter's: its non-daemon threads, then its exit handlers, then the streams flushed. An
    uncaught KeyboardInterrupt ends the process by SIGINT, as the interpreter's does. Returns the exit status
    (an uncaught exception: its traceback on stderr, 1). tests/forked_worker.py runs torchrun's workers with it."""
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code: object = 0
    interrupted = False
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback on stderr, exit status 1
        traceback.print_exc()
        code = 1
    finally:
        threading._shutdown()           # type: ignore[attr-defined]  # the interpreter's exit: threads first,
        atexit._run_exitfuncs()         # then the exit handlers
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    if code is None:
        return 0
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code


def serve(path: str, modules: List[str]) -> None:
    # the server ends with the pytest worker that started it, checked each second in the loop below (a
    # parent-death signal would follow the thread that started it, not the process)
    parent = os.getppid()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # import-time warnings the scripts filter before their own imports
        for name in modules:
            importlib.import_module(name)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)          # the client waits for the name: it appears listening
    listener.listen(64)
    clients: Dict[int, socket.socket] = {}      # child pid -> the connection that asked for it
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, wake_r], [], [], 1.0)
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
            for pid in list(clients):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    conn = clients.pop(pid)
                    try:
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    except OSError:
                        pass            # the test stopped listening; the child is reaped anyway
                    conn.close()
        if listener in ready:
            conn, _ = listener.accept()
            conn.settimeout(30)
            try:
                req, fds = _request(conn)
            except (OSError, ValueError, struct.error) as exc:
                print(f"zygote: a bad request, refused: {exc}", file=sys.stderr)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                try:        # the child never returns into this loop: it would be a second server
                    _child(req, fds, [listener.fileno(), wake_r, wake_w, conn.fileno(),
                                      *(c.fileno() for c in clients.values())])
                except BaseException:  # noqa: BLE001 - e.g. its working directory gone: said, then exit 127
                    traceback.print_exc()
                finally:
                    os._exit(127)
            for fd in fds:
                os.close(fd)
            clients[pid] = conn
            try:
                conn.sendall(f"{pid}\n".encode())
            except OSError:
                pass            # the client left: its child runs on, and is reaped when it ends
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)    # the pytest worker is gone: its exit handler too


# ---- the client side, in the test's process ------------------------------------------------------------------

_SERVERS: Dict[tuple, tuple] = {}       # modules -> (server process, socket path)
_OWNER = os.getpid()


def _server(modules: Sequence[str], env: Dict[str, str]) -> str:
    key = tuple(modules)
    if key in _SERVERS and _SERVERS[key][0].poll() is None:
        return _SERVERS[key][1]
    where = tempfile.mkdtemp(prefix="zygote-")
    path = os.path.join(where, "socket")
    with open(os.path.join(where, "stderr"), "w") as err:
        proc = subprocess.Popen([sys.executable, __file__, path, *modules], env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the fork server importing {list(modules)} did not start within "
                                 f"{STARTUP_TIMEOUT}s:\n{open(os.path.join(where, 'stderr')).read()[-3000:]}")
        time.sleep(0.02)
    if not _SERVERS:
        atexit.register(_stop_servers)      # here, not at import: tests/forked_worker.py imports this module
    _SERVERS[key] = (proc, path)
    return path


def _stop_servers() -> None:
    if os.getpid() != _OWNER:
        return
    for proc, path in _SERVERS.values():
        proc.kill()
        proc.wait(timeout=30)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


STARTUP_TIMEOUT = 120


class Forked:
    """A child of a fork server, used as a subprocess.Popen is (pid, poll, wait, send_signal, kill, returncode)."""

    def __init__(self, args: List[str], conn: socket.socket) -> None:
        self.args, self._conn, self._buf = args, conn, b""
        self.returncode: Optional[int] = None
        self.stdout = self.stderr = None
        self.pid = int(self._line(time.monotonic() + 60, "its pid"))

    def _line(self, deadline: Optional[float], what: str) -> str:
        while b"\n" not in self._buf:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, 0)
            self._conn.settimeout(left)
            try:
                chunk = self._conn.recv(64)
            except socket.timeout:
                raise subprocess.TimeoutExpired(self.args, 0) from None
            if not chunk:
                raise AssertionError(f"the fork server closed the connection before sending {what}: {self.args}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = int(self._line(None if timeout is None else time.monotonic() + timeout,
                                                 "its exit status"))
            except subprocess.TimeoutExpired:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._conn.close()
        return self.returncode

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                self.wait(timeout=0.0001)
            except subprocess.TimeoutExpired:
                return None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(cmd: Sequence[str], modules: Sequence[str], env: Dict[str, str], stdin: int, stdout: int, stderr: int,
          session: bool) -> Forked:
    """``cmd`` (``[sys.executable, SCRIPT, ARGS...]``) forked from the server that imported ``modules``, with
    these standard streams (descriptors, duplicated into the child) and environment, in a new session if
    ``session``."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(_server(modules, env))
    body = json.dumps({"argv": list(map(str, cmd)), "env": env, "cwd": os.getcwd(), "session": session}).encode()
    socket.send_fds(conn, [_HEADER.pack(len(body))], [stdin, stdout, stderr])
    conn.sendall(body)
    return Forked(list(map(str, cmd)), conn)


def run(cmd: Sequence[str], modules: Sequence[str], env: Dict[str, str], timeout: float,
        on_timeout: Optional[Callable[[int], None]] = None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout), forked: on timeout the
    child is killed and subprocess.TimeoutExpired raised (with what it wrote), as subprocess.run does.
    ``on_timeout(pid)`` is called first (tests/hangs.py), and the output read for SETTLE seconds more."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    with open(os.devnull, "rb") as null:
        try:
            proc = popen(cmd, modules, env, null.fileno(), out_w, err_w, session=False)
        finally:
            os.close(out_w)
            os.close(err_w)
    deadline = time.monotonic() + timeout
    chunks: Dict[int, List[bytes]] = {out_r: [], err_r: []}
    timed_out = ended = False
    try:
        with selectors.DefaultSelector() as sel:
            for fd in chunks:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0 and not timed_out and on_timeout is not None:
                    timed_out = True
                    on_timeout(proc.pid)
                    deadline = time.monotonic() + SETTLE
                    continue
                if left <= 0:
                    break
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        sel.unregister(key.fd)
            else:
                ended = not timed_out       # its streams closed before any timeout
        if ended:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        else:
            proc.kill()
            proc.wait(timeout=30)
            said = [b"".join(chunks[fd]) for fd in (out_r, err_r)]
            raise subprocess.TimeoutExpired(proc.args, timeout, output=said[0], stderr=said[1])
    finally:
        os.close(out_r)
        os.close(err_r)
    # text=True's universal newlines: a progress bar's carriage returns read as line ends
    text = [b"".join(chunks[fd]).decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
            for fd in (out_r, err_r)]
    return subprocess.CompletedProcess(proc.args, code, text[0], text[1])


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
