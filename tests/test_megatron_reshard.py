"""Resharding a Megatron checkpoint on resume (megatron-core GPTModel on CPU with gloo, up to 2 ranks per
run): saved at one (TP, PP, DP, VP) layout in either of Megatron's formats (torch_dist; torch, resumed with
concat=True), resumed at another. The model and optimizer state right after the load equals the saved
one exactly, compared as whole global tensors
assembled from every rank's chunks (megatron-core's own sharding metadata says where each chunk goes);
and the losses after the resume stay with those of the saved layout's uninterrupted run: the same state
trained on another decomposition, which agrees to float rounding (within 2e-5 relative here; measured
differences are below 1e-6). Includes MoE: experts split over 2 ranks, resumed with both on each rank;
and virtual pipeline chunks (the interleaved schedule)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import ROOT, assert_losses_close, events, run, script_cmd, wait_no_agent

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")

SCRIPT = ROOT / "examples" / "megatron" / "pretrain_gpt.py"
ITERS = 10
REL = 2e-5

# name: (saved layout, its ranks, resumed layout, its ranks)
CHANGES = {
    "tp2-to-tp1": (["--tp", "2"], 2, [], 1),
    "tp1-to-tp2": ([], 1, ["--tp", "2"], 2),
    "pp2-to-pp1": (["--pp", "2"], 2, [], 1),
    "pp1-to-pp2": ([], 1, ["--pp", "2"], 2),
    "tp2dp1-to-tp1dp2": (["--tp", "2"], 2, [], 2),
    # virtual pipeline (the interleaved schedule): 4 layers as 2 stages x 2 chunks, then in one stage
    "pp2vp2-to-pp1": (["--pp", "2", "--vp", "2", "--num-layers", "4"], 2, ["--num-layers", "4"], 1),
    "pp1-to-pp2vp2": (["--num-layers", "4"], 1, ["--pp", "2", "--vp", "2", "--num-layers", "4"], 2),
    # MoE, 2 experts: split over 2 ranks (EP 2), then both on each rank (EP 1, DP 2)
    "ep2-to-ep1": (["--num-experts", "2", "--ep", "2"], 2, ["--num-experts", "2"], 2),
    "ep1-to-ep2": (["--num-experts", "2"], 2, ["--num-experts", "2", "--ep", "2"], 2),
    # experts split over 2 ranks, then over 4 ranks with DP 4 (the dense optimizer shards of one EP rank's
    # directory alone do not make its parameters whole)
    "ep2dp2-to-ep2dp4": (["--num-experts", "2", "--ep", "2"], 2, ["--num-experts", "2", "--ep", "2"], 4),
}
# in the default tier: one TP change each way of the optimizer and format; the rest run in CI's slow tier
DEFAULT_TIER = {("tp2-to-tp1", "plain", "torch_dist"), ("tp2dp1-to-tp1dp2", "distopt", "torch_dist"),
                ("tp1-to-tp2", "plain", "torch"), ("tp2dp1-to-tp1dp2", "distopt", "torch")}


def cmd(save: Path, loss: Path, layout, nproc: int, *extra: str, fmt: str = "torch_dist"):
    return script_cmd(SCRIPT, nproc, "--cpu", "--quiet", "--save", str(save), "--loss-file", str(loss),
                      "--save-storage-interval", "5", "--agent-idle-timeout", "20", "--ckpt-format", fmt, *layout,
                      *extra, torchrun=True)


def losses(prefix: Path):
    """The last pipeline stage's losses (every rank that writes them agrees): iteration -> hex float."""
    out = {}
    for path in sorted(prefix.parent.glob(prefix.name + ".rank*")):
        for line in path.read_text().splitlines():
            if line and not line.startswith("#"):
                it, v = line.split()
                out[int(it)] = v
    return out


def starts(prefix: Path):
    path = sorted(prefix.parent.glob(prefix.name + ".rank*"))[0]
    return [int(l.split()[2]) for l in path.read_text().splitlines() if l.startswith("# start")]


def global_state(prefix: Path, tag: str):
    """Every tensor of the model and optimizer, whole, from the chunks all ranks dumped."""
    whole = {}
    files = sorted(prefix.parent.glob(f"{prefix.name}.{tag}.rank*.pt"))
    assert files, f"no {tag} dumps under {prefix}"
    for path in files:
        for key, pieces in torch.load(path, weights_only=True).items():
            # a piece: the flat range [first, first + numel) of the block of ``sizes`` at ``offset``
            for offset, sizes, shape, first, data in pieces:
                if key not in whole:
                    whole[key] = torch.full(shape, float("nan"), dtype=data.dtype)
                block = whole[key][tuple(slice(o, o + n) for o, n in zip(offset, sizes))]
                flat = block.reshape(-1).clone()
                flat[first:first + data.numel()] = data
                block.copy_(flat.view(block.shape))
    for key, t in whole.items():
        assert not torch.isnan(t).any(), f"{key}: the dumped chunks do not cover the tensor"
    return whole


@pytest.mark.parametrize("change,opt,fmt", [
    pytest.param(c, o, f, id=f"{c}-{o}-{f}", marks=() if (c, o, f) in DEFAULT_TIER else pytest.mark.slow)
    for f in ("torch_dist", "torch") for c in CHANGES for o in ("plain", "distopt")])
def test_a_checkpoint_resumes_on_another_layout_with_the_same_state(tmp_path, uninterrupted, change, opt, fmt):
    saved, n_saved, resumed, n_resumed = CHANGES[change]
    extra = ["--use-distributed-optimizer"] if opt == "distopt" else []
    # the torch layout reshards with concat=True (the hook passes it)
    again = ["--concat"] if fmt == "torch" else []
    half = ITERS // 2
    ckpt, log = tmp_path / "ckpt", tmp_path / "audit.jsonl"

    def produce(ref: Path):     # the saved layout's uninterrupted run, shared by both formats' tests
        run(cmd(ref / "ckpt", ref / "loss", saved, n_saved, "--iters", str(ITERS), *extra, fmt=fmt), timeout=300)
        wait_no_agent(ref / "ckpt")
        return losses(ref / "loss")
    reference = uninterrupted(("megatron-reshard", n_saved, *saved, *extra), produce)
    run(cmd(ckpt, tmp_path / "a", saved, n_saved, "--iters", str(half), "--dump-state", str(tmp_path / "a"),
            "--ckpt-log", str(log), *extra, fmt=fmt), timeout=300)
    wait_no_agent(ckpt)
    out = run(cmd(ckpt, tmp_path / "b", resumed, n_resumed, "--iters", str(ITERS), "--dump-state",
                  str(tmp_path / "b"), "--ckpt-log", str(log), *extra, *again, fmt=fmt), timeout=300)
    assert "resharded to" in out.stdout + out.stderr
    assert starts(tmp_path / "b") == [half]
    loads = [e for e in events(log) if e["event"] == "load" and e.get("step")]
    assert loads and all(e["source"] == "storage" for e in loads), "another layout must load from storage"

    before, after = global_state(tmp_path / "a", "final"), global_state(tmp_path / "b", "loaded")
    assert sorted(before) == sorted(after)
    for key in before:
        assert torch.equal(before[key], after[key]), f"{key} differs after resharding ({change}, {opt}, {fmt})"
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in before), sorted(before)[:5]

    got = losses(tmp_path / "b")
    assert sorted(got) == list(range(half + 1, ITERS + 1))
    assert_losses_close(got, reference, range(half + 1, ITERS + 1), rel=REL)
    wait_no_agent(ckpt)


# per format: the data file stage 0 reads part of, and the file of the second stage's (PP 2) checkpoint
# whose layer item is damaged
PARTIAL = {"torch_dist": ("__0_0.distcp", "__1_0.distcp"),
           "torch": ("mp_rank_00/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt")}


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_resume_on_another_layout_reads_only_the_items_it_needs_and_a_damaged_one_falls_back(tmp_path, fmt):
    """Saved on one pipeline stage, resumed on two: each stage reads and checks only the items of the
    data file its layers need (the manifest records each item's place and checksum: distcp items; in
    the torch layout the pickle and each tensor's storage), never the whole file. A flipped byte inside an
    item a stage needs rejects that step for every rank, and the previous one is resumed, on the new
    layout too."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "audit.jsonl"
    again = ["--concat"] if fmt == "torch" else []
    run(cmd(ckpt, tmp_path / "a", [], 1, "--iters", "10", "--ckpt-log", str(log), fmt=fmt), timeout=300)
    wait_no_agent(ckpt)
    run(cmd(ckpt, tmp_path / "b", ["--pp", "2"], 2, "--iters", "11", "--ckpt-log", str(log), *again, fmt=fmt),
        timeout=300)
    wait_no_agent(ckpt)
    loads = [e for e in events(log) if e["event"] == "load" and e.get("step") == 10]
    whole, damaged = PARTIAL[fmt]
    data = (ckpt / "iter_0000010" / whole).stat().st_size
    assert len(loads) == 2 and all(e["bytes"] < data for e in loads), (data, loads)

    man = json.loads((ckpt / "iter_0000011" / "easyckpt_manifest.json").read_text())
    items = man["files"][damaged]["items"]
    layer = next(i for i in items if i[3] and i[3][0].lstrip("/").startswith(("decoder.layers.", "model/decoder.layers."))
                 and i[1] > 64)
    path = ckpt / "iter_0000011" / damaged
    raw = bytearray(path.read_bytes())
    raw[layer[0] + layer[1] // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    out = run(cmd(ckpt, tmp_path / "c", [], 1, "--iters", "12", "--ckpt-log", str(log), *again, fmt=fmt),
              timeout=300)
    loads = [e for e in events(log) if e["event"] == "load" and e.get("step")]
    assert loads[-1]["step"] == 10 and loads[-1]["source"] == "storage", loads[-1]
    assert f"{damaged}: item" in out.stdout + out.stderr and "corrupted" in out.stdout + out.stderr
    wait_no_agent(ckpt)


# slow tier: four ranks of a framework on the 2 cores, beside the default tier's other workers, pushed timing-bound
# tests there past their limits (a restart slower than the agent's idle timeout)
# name: (killed run's layout, its ranks, restarted layout, its ranks, what the resume line says of the change)
IN_MEMORY = {
    "dp4-to-dp2": ([], 4, [], 2, "4 → 2 ranks"),
    # the same world size on another layout: the memory source passes these snapshots over, the resharded one not
    "tp2dp1-to-tp1dp2": (["--tp", "2"], 2, [], 2, "layout tp2.pp1.dp1.vp1.ep1 → tp1.pp1.dp2.vp1.ep1"),
    "pp2-to-pp1": (["--pp", "2"], 2, [], 1, "2 → 1 ranks"),
}


@pytest.mark.slow
@pytest.mark.parametrize("change", sorted(IN_MEMORY))
def test_a_job_restarted_on_another_layout_reshards_from_memory_through_megatrons_reader(tmp_path, change):
    """torch_dist with the distributed optimizer, killed while the agent keeps its snapshots, restarted on another
    layout (data-parallel 4 -> 2, TP 2 -> 1 on the same 2 ranks, PP 2 -> 1): the newest step whole in memory is
    written out in this node's /dev/shm as storage would hold it (engine/load/render.py) and Megatron's own reader
    reshards it; nothing is read from the save dir's steps and the copy is gone afterwards. The state right after
    the load equals that of a resume of the same step from storage, tensor by tensor; the losses after it agree
    with that resume's to float rounding (REL: its step was committed by a run's finalize, whose RNG state is not
    the killed run's mid-training snapshot's)."""
    from harness import SHM, job_id, killed_then_restarted, why_not_memory

    saved, n_saved, resumed, n_resumed, said_change = IN_MEMORY[change]
    common = ["--use-distributed-optimizer", "--global-batch-size", "8", "--iters", str(ITERS + 2)]
    ckpt, log = tmp_path / "ckpt", tmp_path / "audit.jsonl"
    mem, ref = tmp_path / "mem", tmp_path / "ref"
    step, said = killed_then_restarted(
        cmd(ckpt, mem, saved, n_saved, *common, "--step-sleep", "0.3", "--ckpt-log", str(log),
            "--agent-idle-timeout", "120"),
        cmd(ckpt, mem, resumed, n_resumed, *common, "--ckpt-log", str(log), "--dump-state", str(mem)), mem, tmp_path,
        7, log, n_saved, watch=n_saved - 1 if "--pp" in saved else 0)     # (the last stage writes the losses)
    wait_no_agent(ckpt)
    loads = {(e["rank"], e["source"], e.get("saved_world_size")) for e in events(log)
             if e["event"] == "load" and e["step"] == step}
    assert loads == {(r, "resharded", n_saved) for r in range(n_resumed)}, (loads, why_not_memory(said, log))
    assert f"resumed step {step} from memory, resharded {said_change}: the slots of 1 node; 0 B moved between " \
           f"nodes, 0 bytes read from storage" in said, said[-3000:]
    assert not list(SHM.glob(f"easyckpt-render-{job_id(ckpt)}-*")), "the written-out step was left"
    run(cmd(ref / "ckpt", ref, saved, n_saved, *common[:-1], str(step)), timeout=400)
    wait_no_agent(ref / "ckpt")
    run(cmd(ref / "ckpt", ref, resumed, n_resumed, *common, "--dump-state", str(ref)), timeout=400)
    wait_no_agent(ref / "ckpt")
    from_memory, from_storage = global_state(mem, "loaded"), global_state(ref, "loaded")
    assert sorted(from_memory) == sorted(from_storage)
    for key in from_memory:
        assert torch.equal(from_memory[key], from_storage[key]), f"{key} differs from the resume from storage"
    got, want = losses(mem), losses(ref)
    assert_losses_close(got, want, range(step + 1, ITERS + 3), rel=REL)
