"""What easyckpt costs a training loop's step time at default settings, as a user measures it, in several regimes:
each a ratio measured side by side in one run, with easyckpt / without, alternating order, fresh processes.

    .venv/bin/python benchmarks/bench_overhead.py [--regimes pt10,pt100,hf10,loop074] [--pairs 5]

Regimes (the step times are this machine's; the sizes are fixed):
  pt10     plain PyTorch, an MLP with AdamW, about 10 ms steps (easyckpt.pytorch, default settings)
  pt100    the same, about 100 ms steps
  hf10     the HF Trainer, a tiny GPT-2, about 10 ms steps (TrainerWrapper, default settings)
  loop074  bench_checkpoint.py's loop: 0.25 GB of state, about 0.74 s steps (save_storage_interval=10)

Per pair it starts the loop twice, once without checkpoints and once with easyckpt, in alternating order (with the
control, twice more without), and then with torch DCP's ``async_save`` and with DLRover's flash checkpoint (to
memory; launched by its own ``dlrover-run`` from .venv-dlrover, benchmarks/setup_dlrover.sh) every k steps, k the
number of steps between easyckpt's snapshots in that pair (the same loss bound). In the HF Trainer regime each
peer saves the Trainer's model and optimizer from a callback at the step's end (DLRover's own FlashCkptTrainer
imports DeepSpeed and overrides the Trainer's internals of transformers 4: it is not the one measured). Neither
peer persists more than that, while easyckpt also persists every save_storage_interval steps as its defaults say
(DLRover's disk saves every 5 steps of 10 ms held its loop for minutes): the comparison is tilted against
easyckpt. The step time is the mean over the steady part of the run (from the step easyckpt's
snapshot budget decided its cadence, the same steps in every run of the pair); the whole run's time is printed
too.

``--control`` (on by default; ``--no-control``): each pair also compares a run without checkpoints with another
(A/A), measured the same way: how far apart two runs of the same loop land on this machine, printed beside
easyckpt's ratio. On the 2-core test VM two identical HF Trainer runs landed ×0.99–1.26 apart one after the
other, ×0.97–1.14 taking turns.

``--interleave S`` (0, the default: one run after the other): the two runs compared start together and take
turns on the machine, S seconds each: the one not running is stopped (SIGSTOP to it and every process under it,
easyckpt's agent included, SIGCONT at its turn), and each run's step time counts only the time it ran. On a
shared VM the same loop's speed drifts by 20 % within minutes (its CPU seconds for the same 1,600 steps: 49 s in
one run, 60 s in the next), which runs one after the other measure as much as easyckpt; turns put both runs
through the same drift. Not the default: the pauses are in the step times easyckpt's budget measures, and with
turns of 1 s it chose snapshots every step in one pair and every 48 steps in another (14-23 without turns), so
the system measured was not the one a user runs. Nor do turns remove each process's own speed: two identical
runs taking turns still landed up to 14 % apart. With turns each peer runs in turns with a run without
checkpoints of its own, at easyckpt's interval. The audit log is searched for waits on the agent that timed out
(a pause may stop a wait), and the pair says how many.

``--in-process``: the two runs of each comparison (and of the control, and each peer's against a run without
checkpoints of its own) are blocks of one process, one after the other in the pair's order, each with a fresh
model, optimizer and Trainer and easyckpt initialized and finalized within it (DLRover's pair under dlrover-run).
Each process keeps a speed of its own (identical runs in two processes landed up to 14 % apart even taking turns);
blocks of one process share it. Nothing of easyckpt's runs on into the next block: its agent leaves when the
block's finalize says goodbye. The first block of a process tends to be the slow one (pt10, one pair: the run without
checkpoints first, easyckpt x0.65 and the A/A x0.89; hf10, a probe of four blocks: 15.0 ms a step first, 10.6
third): the pairs' alternating order is what balances it, so use an even number of pairs.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GOAL = 1.03
# steps per run, and where the steady part starts at the latest (the budget's agreement steps: 2 s of
# warmup, then as many steps of measuring, then the cadence)
REGIMES: Dict[str, Dict[str, Any]] = {
    "pt10": {"hidden": 640, "batch": 64, "steps": 1600},
    "pt100": {"hidden": 1400, "batch": 256, "steps": 260},
    "hf10": {"steps": 1600},
    "loop074": {"width": 2048, "layers": 5, "batch": 2048, "steps": 80, "storage": 10},
}
RUN_TIMEOUT = 900
AGAIN = "none-again"     # the control: a second run without checkpoints, compared with the first (A/A)
sys.path.insert(0, HERE)
import bench_peer  # noqa: E402  (DLRover's leftovers, found and removed as bench_peer does)
import turns  # noqa: E402
DLROVER_PYTHON = os.path.join(ROOT, ".venv-dlrover", "bin", "python")


def _mlp(spec: Dict[str, Any]) -> Any:
    """The regime's MLP; loop074: bench_checkpoint.py's (bias-free 2048-wide layers, 0.25 GB with AdamW)."""
    import torch
    if "width" in spec:
        w = spec["width"]
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(w, w, bias=False), torch.nn.ReLU())
                                     for _ in range(spec["layers"])])
    h = spec["hidden"]
    return torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                               torch.nn.ReLU(), torch.nn.Linear(h, h))


def _loop(model: Any, opt: Any, x: Any, steps: int, after: Callable[[int], None]) -> List[float]:
    """The training loop every plain regime runs; ``after(step)`` after each optimizer step (the save, if any).
    Returns when each step began, and the end."""
    began = []
    for step in range(1, steps + 1):
        began.append(time.perf_counter())
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        after(step)
    began.append(time.perf_counter())
    return began


def worker_plain(regime: str, mode: str, every: int, save_dir: str) -> List[float]:
    """One run of a plain PyTorch loop; the time each step began (and the end)."""
    import torch
    spec = REGIMES[regime]
    torch.manual_seed(0)
    model = _mlp(spec)
    opt = torch.optim.AdamW(model.parameters(), 1e-4)
    x = torch.randn(spec["batch"], spec.get("width", spec.get("hidden")))
    if mode == "easyckpt":
        import easyckpt.pytorch as ep
        ep.initialize_easyckpt(save_dir, **({"save_storage_interval": spec["storage"]} if "storage" in spec else {}))
        ep.load_checkpoint(model, opt)
        began = _loop(model, opt, x, spec["steps"], lambda step: ep.save_checkpoint_if_needed(step, model, opt))
        ep.finalize_easyckpt()
        return began
    if mode == "none":
        return _loop(model, opt, x, spec["steps"], lambda step: None)
    save, end = peer_saver(mode, every, save_dir, model, opt)
    began = _loop(model, opt, x, spec["steps"], save)
    end()
    return began


def peer_saver(mode: str, every: int, save_dir: str, model: Any, opt: Any
               ) -> Tuple[Callable[[int], None], Callable[[], None]]:
    """A peer's save every ``every`` steps, as its documentation shows, and what ends the run: torch DCP's
    ``async_save`` (one save in flight) or DLRover's flash checkpoint to memory (under dlrover-run)."""
    if mode == "dlrover":
        import torch.distributed as dist
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
        own_group = not dist.is_initialized()       # the HF Trainer under dlrover-run starts one of its own
        if own_group:
            dist.init_process_group("gloo")
        ckpt = DdpCheckpointer(save_dir)
        ckpt.load_checkpoint()

        def save_dlrover(step: int) -> None:
            if step % every == 0:
                ckpt.save_checkpoint(step, {"model": model.state_dict(), "optimizer": opt.state_dict()},
                                     storage_type=StorageType.MEMORY)
        return save_dlrover, (dist.destroy_process_group if own_group else lambda: None)
    import torch.distributed.checkpoint as dcp
    pending: List[Any] = []

    def save_dcp(step: int) -> None:
        if step % every:
            return
        if pending:
            pending.pop().result()        # one save in flight at a time, as DCP's documentation shows
        pending.append(dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                      checkpoint_id=os.path.join(save_dir, f"step_{step}")))

    def end() -> None:
        for p in pending:
            p.result()
    return save_dcp, end


def worker_hf(mode: str, every: int, save_dir: str) -> List[float]:
    """One run of the HF Trainer on a tiny GPT-2 (random tokens); the time each step began."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    torch.manual_seed(0)
    began: List[float] = []

    peer: List[Tuple[Callable[[int], None], Callable[[], None]]] = []

    class Stopwatch(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            began.append(time.perf_counter())

        def on_step_end(self, _args: Any, state: Any, _control: Any, **kw: Any) -> None:
            if mode in ("dcp", "dlrover"):       # a peer saves the Trainer's model and optimizer at the bound
                if not peer:
                    peer.append(peer_saver(mode, every, save_dir, kw["model"], kw["optimizer"]))
                peer[0][0](state.global_step)

        def on_train_end(self, *_: Any, **__: Any) -> None:
            for _, end in peer:
                end()
            began.append(time.perf_counter())

    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (4096, 32))]
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    args = TrainingArguments(output_dir=save_dir, use_cpu=True, report_to=[], max_steps=REGIMES["hf10"]["steps"],
                             per_device_train_batch_size=4, logging_strategy="no", disable_tqdm=True,
                             save_strategy="steps" if mode == "easyckpt" else "no", dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Stopwatch()])
    if mode == "easyckpt":
        from easyckpt.transformers import TrainerWrapper
        trainer = TrainerWrapper(trainer)
    trainer.train()
    return began[:1] + began[1:]


def worker(args: argparse.Namespace) -> None:
    """One run, or (``--mode a,b``: --in-process) one block per mode, each in a save dir of its own."""
    modes = args.mode.split(",")
    done = []
    for i, name in enumerate(modes):
        save_dir = args.save_dir if len(modes) == 1 else os.path.join(args.save_dir, f"block{i}")
        os.makedirs(save_dir, exist_ok=True)
        mode = "none" if name == AGAIN else name
        began = (worker_hf(mode, args.every, save_dir) if args.regime == "hf10"
                 else worker_plain(args.regime, mode, args.every, save_dir))
        done.append({"mode": name, "save_dir": save_dir, "began": began})
    with open(args.out, "w") as f:
        json.dump(done[0]["began"] if len(modes) == 1 else done, f)


def _cadence(save_dir: str) -> Optional[Dict[str, Any]]:
    """easyckpt's budget events of a run (the audit log in its save dir)."""
    path = os.path.join(save_dir, "easyckpt.log")
    if not os.path.exists(path):
        return None
    found = [json.loads(line) for line in open(path) if '"budget"' in line]
    found = [e for e in found if e.get("event") == "budget"]
    return {"first": found[0]["step"], "last": found[-1]} if found else None


def _command(regime: str, mode: str, every: int, workdir: str) -> Tuple[List[str], str, str]:
    """(the worker's command line, its save dir, where it writes its step times)."""
    save_dir = tempfile.mkdtemp(dir=workdir)
    out = os.path.join(save_dir, "began.json")
    cmd = [sys.executable, __file__]
    if "dlrover" in mode.split(","):      # its own launcher, from its own venv
        cmd = [DLROVER_PYTHON, os.path.join(HERE, "dlrover_launch.py"), "--standalone", "--nproc_per_node=1",
               __file__]
    return cmd + ["--worker", "--regime", regime, "--mode", mode, "--every", str(every), "--save-dir", save_dir,
                  "--out", out], save_dir, out


def _env() -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))


def _began(out: str) -> List[float]:
    with open(out) as f:
        return json.load(f)


def _result(mode: str, save_dir: str, began: List[float], wall: float,
            windows: Optional[List[Tuple[float, float]]] = None) -> Dict[str, Any]:
    return {"began": began, "wall": wall, "windows": windows,
            "cadence": _cadence(save_dir) if mode == "easyckpt" else None,
            "timed_out_waits": _timed_out_waits(save_dir) if mode == "easyckpt" else None}


def launch(regime: str, mode: str, every: int, workdir: str) -> Dict[str, Any]:
    cmd, save_dir, out = _command(regime, mode, every, workdir)
    before = bench_peer._dlrover_leftovers() if mode == "dlrover" else None
    t = time.perf_counter()
    try:
        subprocess.run(cmd, env=_env(), check=True, timeout=RUN_TIMEOUT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        if before is not None:      # DLRover's own segments and directories, left behind after its run
            bench_peer._clean(before)
    return _result(mode, save_dir, _began(out), time.perf_counter() - t)


def interleaved(regime: str, modes: List[str], every: int, workdir: str, turn: float) -> Dict[str, Dict[str, Any]]:
    """Run ``modes`` at once, taking turns of ``turn`` seconds (the others stopped); each run's result with the
    windows of time it ran."""
    before = bench_peer._dlrover_leftovers() if "dlrover" in modes else None
    specs = [_command(regime, mode, every, workdir) for mode in modes]
    procs = [subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True) for cmd, _, _ in specs]
    for p in procs[1:]:
        turns.signal_tree(p.pid, signal.SIGSTOP)
    try:
        windows = turns.take_turns(procs, turn, RUN_TIMEOUT * len(procs), f"{regime} {modes}")
    finally:
        if before is not None:
            bench_peer._clean(before)
    for mode, p in zip(modes, procs):
        if p.returncode:
            raise subprocess.CalledProcessError(p.returncode, f"{regime} {mode} worker")
    return {mode: _result(mode, save_dir, _began(out), sum(b - a for a, b in w), w)
            for mode, (_, save_dir, out), w in zip(modes, specs, windows)}


def blocks(regime: str, modes: List[str], every: int, workdir: str) -> Dict[str, Dict[str, Any]]:
    """``--in-process``: ``modes`` run one after the other in one process (a fresh model, optimizer and Trainer
    each, easyckpt initialized and finalized in its own), each block's result as a run's."""
    cmd, save_dir, out = _command(regime, ",".join(modes), every, workdir)
    before = bench_peer._dlrover_leftovers() if "dlrover" in modes else None
    try:
        subprocess.run(cmd, env=_env(), check=True, timeout=RUN_TIMEOUT * len(modes),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        if before is not None:
            bench_peer._clean(before)
    with open(out) as f:
        done = json.load(f)
    return {b["mode"]: _result(b["mode"], b["save_dir"], b["began"], b["began"][-1] - b["began"][0]) for b in done}


def _timed_out_waits(save_dir: str) -> int:
    """Warnings of the run's audit log about the agent not answering in time (a turn may stop a wait)."""
    path = os.path.join(save_dir, "easyckpt.log")
    if not os.path.exists(path):
        return 0
    return sum(1 for line in open(path) if '"warning"' in line and "did not answer" in line)


def _per_step(run: Dict[str, Any], first: int) -> float:
    """Seconds per step from step ``first`` to the end, counting only the time the run ran (its windows, when it
    took turns)."""
    began = run["began"]
    first = min(first, len(began) - 2)
    start, end = began[first], began[-1]
    windows = run.get("windows")
    ran = end - start if windows is None else sum(max(0.0, min(b, end) - max(a, start)) for a, b in windows)
    return ran / (len(began) - 1 - first)


def one_pair(regime: str, index: int, workdir: str, turn: float, control: bool, in_process: bool = False
             ) -> Dict[str, Any]:
    def compare(modes: List[str], every: int) -> Dict[str, Dict[str, Any]]:
        if in_process:
            return blocks(regime, modes, every, workdir)
        if turn > 0:
            return interleaved(regime, modes, every, workdir, turn)
        return {mode: launch(regime, mode, every, workdir) for mode in modes}
    order = ["none", "easyckpt"] if index % 2 == 0 else ["easyckpt", "none"]
    runs = compare(order, 1)
    cadence = runs["easyckpt"]["cadence"]
    every = cadence["last"]["every"] if cadence else 1
    # the steady part: from the step the cadence was first decided (by then both runs are warm)
    first = cadence["first"] if cadence else len(runs["none"]["began"]) // 2
    base = _per_step(runs["none"], first)
    row = {"order": order, "turn": turn, "in_process": in_process, "steady_from": first, "step_none": base,
           "ratio": _per_step(runs["easyckpt"], first) / base,
           "whole_run_ratio": runs["easyckpt"]["wall"] / runs["none"]["wall"],
           "every": every, "bound": cadence["last"]["bound"] if cadence else 0,
           "persist_every": cadence["last"].get("persist_every") if cadence else None,
           "said_cost": cadence["last"]["cost"] if cadence else None,
           "said_per_step": cadence["last"]["per_step"] if cadence else None,
           "timed_out_waits": runs["easyckpt"]["timed_out_waits"]}
    if control:
        got = compare([AGAIN, "none"] if index % 2 == 0 else ["none", AGAIN], 1)
        row["control_ratio"] = _per_step(got[AGAIN], first) / _per_step(got["none"], first)
    for peer in ("dcp", "dlrover"):
        if peer == "dlrover" and not os.path.exists(DLROVER_PYTHON):
            continue
        try:
            if turn > 0 or in_process:         # against a run without checkpoints of its own, in turns or blocks
                got = compare(["none", peer], every)
                row[f"{peer}_ratio"] = _per_step(got[peer], first) / _per_step(got["none"], first)
            else:
                row[f"{peer}_ratio"] = _per_step(launch(regime, peer, every, workdir), first) / base
        except (subprocess.SubprocessError, OSError) as exc:     # said, and the pair goes on without it
            row[f"{peer}_failed"] = str(exc)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regimes", default="pt10,pt100,hf10,loop074")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--out", default=os.path.join(HERE, "results", "overhead.json"))
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                   help="an A/A pair (no checkpoints in either run) per pair: the machine's own spread")
    p.add_argument("--interleave", type=float, default=0.0, metavar="S",
                   help="the runs compared take turns of S seconds (0, the default: one after the other)")
    p.add_argument("--in-process", action="store_true",
                   help="the two runs of each comparison as blocks of one process, one after the other")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--regime", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--every", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--save-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    results: Dict[str, Any] = {}
    for regime in args.regimes.split(","):
        with tempfile.TemporaryDirectory(prefix="bench-overhead-") as workdir:
            rows = []
            for i in range(args.pairs):
                row = one_pair(regime, i, workdir, args.interleave, args.control, args.in_process)
                rows.append(row)
                print(f"{regime} pair {i + 1}: step {row['step_none'] * 1e3:.2f} ms, easyckpt x{row['ratio']:.3f} "
                      f"(whole run x{row['whole_run_ratio']:.3f}), every {row['every']} (bound {row['bound']}), "
                      f"persists every {row['persist_every']}, "
                      + (f"said {1e3 * (row['said_per_step'] or 0):.3f} ms/step" if not args.interleave else
                         "said (not comparable: the turns' pauses are in its step times)")
                      + (f", A/A x{row['control_ratio']:.3f}" if "control_ratio" in row else "")
                      + "".join(f", {peer} every {row['every']} x{row[f'{peer}_ratio']:.3f}"
                                for peer in ("dcp", "dlrover") if f"{peer}_ratio" in row)
                      + "".join(f", {peer} FAILED ({row[f'{peer}_failed']})"
                                for peer in ("dcp", "dlrover") if f"{peer}_failed" in row)
                      + (f", {row['timed_out_waits']} wait(s) on the agent timed out"
                         if row["timed_out_waits"] else ""), flush=True)
        results[regime] = {"pairs": rows, "median_ratio": statistics.median(r["ratio"] for r in rows),
                           "bounds": [r["bound"] for r in rows]}
        controls = [r["control_ratio"] for r in rows if "control_ratio" in r]
        if controls:
            results[regime]["control"] = {"median": statistics.median(controls), "min": min(controls),
                                          "max": max(controls)}
        for peer in ("dcp", "dlrover"):
            got = [r[f"{peer}_ratio"] for r in rows if f"{peer}_ratio" in r]
            results[regime][f"median_{peer}_ratio"] = statistics.median(got) if got else None
    if not os.path.exists(DLROVER_PYTHON):
        print(f"\nDLRover: {DLROVER_PYTHON} is missing (bash benchmarks/setup_dlrover.sh makes it): not compared")
    print("\nregime   step (ms)  easyckpt/none  goal <= 1.03  loss bound (steps)  DCP async_save  DLRover flash"
          "  (each /none, at easyckpt's bound; the goal: easyckpt <= both)")
    for regime, res in results.items():
        step = statistics.median(r["step_none"] for r in res["pairs"]) * 1e3
        peers = [res[f"median_{peer}_ratio"] for peer in ("dcp", "dlrover")]
        shown = [f"{v:.3f}" if v is not None else "-" for v in peers]
        verdict = "PASS" if res["median_ratio"] <= GOAL else "MISS"
        compared = [v for v in peers if v is not None]
        beats = "-" if not compared else "PASS" if all(res["median_ratio"] <= v for v in compared) else "MISS"
        print(f"{regime:8s} {step:9.2f}  {res['median_ratio']:13.3f}  {verdict:12s}  {str(res['bounds']):18s}  "
              f"{shown[0]:14s}  {shown[1]:13s}  {beats}")
        if "control" in res:
            c = res["control"]
            print(f"{'':8s} A/A (no checkpoints in either run): median x{c['median']:.3f}, x{c['min']:.3f}-"
                  f"{c['max']:.3f}: ratios this far from 1 are the machine's, not easyckpt's")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
