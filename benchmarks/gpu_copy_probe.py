"""Does a device-to-host copy call return at once, or does it hold the calling thread (and others)?

    python benchmarks/gpu_copy_probe.py

Issue 50, item 7. On the Firecracker H200 of 2026-11-28 the overlapped snapshot hid none of its copy when the
loop read its loss with ``loss.item()`` after ``save`` (bench_gpu.py: x1.454, the GPU idle 72 ms a step), and all of
it when the loop waited for its stream instead (x1.004). Queuing the whole snapshot from the training thread made
``save`` itself take 160 ms: the first ``copy_(non_blocking=True)`` into the page-locked slot returned only once its
stream could run it. This probe times, with the GPU busy for about --busy-ms, the host time of one asynchronous
64 MiB device-to-host copy call into each kind of host memory (torch's own page-locked memory, and memory
registered with cudaHostRegister as the snapshot slots are: an anonymous mapping and a shared file mapping in
/dev/shm, with flags 0 and portable|mapped), and whether a thread waiting in ``loss.item()`` holds back another
thread's copies and kernel launches. Each line is one measurement; nothing is asserted.
"""
from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import threading
import time
from typing import Callable, List, Tuple

import torch

PIECE = 64 << 20


def busy(ms: float) -> None:
    """Queue about ``ms`` of matrix products on the current stream."""
    a = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    b = a @ a
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t, 1e-4) * 1e3
    for _ in range(max(1, int(ms / one))):
        b = a @ b
    del b


def registered(kind: str, flags: int) -> Tuple[torch.Tensor, Callable[[], None]]:
    """PIECE bytes of host memory registered with CUDA, and how to release them."""
    if kind == "anon":
        mm = mmap.mmap(-1, PIECE)
        path = None
    else:
        fd, path = tempfile.mkstemp(prefix="easyckpt-probe-", dir="/dev/shm")
        os.ftruncate(fd, PIECE)
        mm = mmap.mmap(fd, PIECE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
    host = torch.frombuffer(mm, dtype=torch.uint8)
    host.fill_(1)      # touched, as a slot is before its first snapshot
    err = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), PIECE, flags))
    if err:
        if path:
            os.unlink(path)
        raise RuntimeError(f"cudaHostRegister error {err}")

    def release() -> None:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        if path:
            os.unlink(path)
    return host, release


def copy_call(dst: torch.Tensor, src: torch.Tensor, depend: bool, busy_ms: float) -> Tuple[float, float]:
    """Host time of ``dst.copy_(src, non_blocking=True)`` on a side stream while the GPU is busy (the side stream
    waits for that work when ``depend``), and of the wait for it after."""
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    busy(busy_ms)
    if depend:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        call = time.perf_counter() - t
    t = time.perf_counter()
    torch.cuda.synchronize()
    return call * 1e3, (time.perf_counter() - t) * 1e3


def while_item(dst: torch.Tensor, src: torch.Tensor, busy_ms: float) -> str:
    """Another thread's copy call (independent stream) and kernel launch while this thread waits in item()."""
    loss = torch.zeros((), device="cuda")
    side = torch.cuda.Stream()
    out: List[str] = []
    started = threading.Event()

    def other() -> None:
        started.wait()
        time.sleep(0.01)      # the main thread is inside item() by now
        with torch.cuda.stream(side):
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            c = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            src.add_(0)
            k = (time.perf_counter() - t) * 1e3
        out.append(f"copy call {c:.1f} ms, kernel launch {k:.1f} ms")

    torch.cuda.synchronize()
    busy(busy_ms)
    loss = loss + 1
    th = threading.Thread(target=other)
    th.start()
    t = time.perf_counter()
    started.set()
    loss.item()
    waited = (time.perf_counter() - t) * 1e3
    th.join()
    torch.cuda.synchronize()
    return f"main thread in item() {waited:.1f} ms; other thread: {out[0] if out else 'nothing'}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--busy-ms", type=float, default=100.0)
    args = p.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    src = torch.randint(0, 255, (PIECE,), dtype=torch.uint8, device="cuda")
    kinds: List[Tuple[str, Callable[[], Tuple[torch.Tensor, Callable[[], None]]]]] = [
        ("torch pinned (cudaHostAlloc)",
         lambda: (torch.empty(PIECE, dtype=torch.uint8, pin_memory=True), lambda: None)),
        ("pageable", lambda: (torch.empty(PIECE, dtype=torch.uint8).fill_(1), lambda: None)),
        ("anonymous mapping, registered 0", lambda: registered("anon", 0)),
        ("/dev/shm file mapping, registered 0 (the slots)", lambda: registered("shm", 0)),
        ("/dev/shm file mapping, registered portable|mapped", lambda: registered("shm", 3)),
    ]
    for name, make in kinds:
        try:
            dst, release = make()
        except Exception as exc:      # noqa: BLE001 - a probe: say what failed and go on
            print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
            continue
        try:
            copy_call(dst, src, True, 10)      # warm
            dep = copy_call(dst, src, True, args.busy_ms)
            ind = copy_call(dst, src, False, args.busy_ms)
            item = while_item(dst, src, args.busy_ms)
            print(f"{name}:\n  after the busy stream: call {dep[0]:.1f} ms, then wait {dep[1]:.1f} ms\n"
                  f"  on a free stream:      call {ind[0]:.1f} ms, then wait {ind[1]:.1f} ms\n  {item}", flush=True)
        except Exception as exc:      # noqa: BLE001 - a probe: say what failed and go on
            print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
        finally:
            try:
                torch.cuda.synchronize()      # no copy into it still queued
            finally:
                release()      # the /dev/shm file and its registration go whatever happened
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
