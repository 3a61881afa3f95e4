"""Manifests are data from disk (docs/reliability.md rows 16, 20, 25): what they name is read only inside its
step, a malformed one rejects its step (logged, the job starts from the previous one), the operator tools
report it in one line, and DeepSpeed's converters read only listed, verified files, never running a pickle.

Real runs write the checkpoints: the plain PyTorch loop on 2 ranks (torchrun, gloo), the DeepSpeed engine
on 2 ranks, resumed on 1 through DeepSpeed's universal checkpoint.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from harness import ROOT, cli, events, run, script_cmd, train_cmd, wait_no_agent
from inproc import run_worker

from easyckpt.errors import EasyCkptError, ManifestError
from easyckpt.formats import manifest as mf
from easyckpt.formats.manifest import MANIFEST_NAME
from easyckpt.storage import stepfiles

FAST = ["--idle-timeout", "1"]


@pytest.fixture(scope="module")
def committed(tmp_path_factory) -> Path:
    """A 2-rank job that committed steps 2 and 4."""
    ckpt = tmp_path_factory.mktemp("trust") / "ckpt"
    run_worker(train_cmd(ckpt, 2, "--iters", "4", "--storage-interval", "2", "--hidden", "8", *FAST), timeout=180)
    wait_no_agent(ckpt)
    return ckpt


@pytest.fixture
def ckpt(committed: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(committed, tmp_path / "ckpt"))


def step_dir(ckpt: Path, step: int) -> Path:
    return ckpt / f"step_{step:08d}"


def rewrite(step: Path, edit) -> None:
    man = json.loads((step / MANIFEST_NAME).read_text())
    edit(man)
    (step / MANIFEST_NAME).write_text(json.dumps(man))


def list_file(step: Path, rel: str, data: bytes, fmt: str = "raw") -> None:
    rewrite(step, lambda m: m["files"].__setitem__(rel, {"size": len(data), "checksum": mf.checksum(data),
                                                         "format": fmt}))


def probe(ckpt: Path, tmp: Path, nproc: int = 2):
    """A 2-rank run of the job (``ckpt`` is a copy: no memory snapshot of it exists) that loads the newest
    checkpoint and stops: (step loaded, audit events)."""
    log = tmp / "probe.jsonl"
    run_worker(train_cmd(ckpt, nproc, "--iters", "0", "--hidden", "8", "--log-file", str(log),
                  *FAST), extra_env={"EASYCKPT_SHM_LEFTOVER_SECONDS": "0"}, timeout=180)
    wait_no_agent(ckpt)
    ev = events(log)
    return [e for e in ev if e["event"] == "load"][-1]["step"], ev


# ---- item 6: a manifest's paths stay inside its step ------------------------------------------------------

@pytest.mark.parametrize("rel", ["/etc/passwd", "../x", "a/../../x", "a//b", "./a", "a/./b", "", "a\\b",
                                 "a\x00b", "a/"])
def test_a_manifest_path_that_could_leave_the_step_is_refused(tmp_path, rel):
    with pytest.raises(ManifestError):
        stepfiles.entry_path(str(tmp_path), rel)


def test_a_listed_symlink_out_of_the_step_is_refused_and_not_followed(tmp_path):
    outside = tmp_path / "secret.json"
    outside.write_text('{"secret": 1}')
    step = tmp_path / "step"
    (step / "sub").mkdir(parents=True)
    (step / "sub" / "ok.json").write_text("{}")
    os.symlink(outside, step / "link.json")
    os.symlink(tmp_path, step / "dirlink")
    assert stepfiles.entry_path(str(step), "sub/ok.json") == os.path.join(os.path.realpath(step), "sub", "ok.json")
    for rel in ("link.json", "dirlink/secret.json"):
        with pytest.raises(ManifestError, match="outside the step"):
            stepfiles.entry_path(str(step), rel)
        with pytest.raises(ManifestError):
            stepfiles.read_entry(str(step), rel)


def test_ls_verify_inspect_and_the_loader_never_read_what_a_manifest_names_outside_the_step(ckpt, tmp_path):
    secret = tmp_path / "secret.json"
    head = '{"password": "hunter2-outside-the-save-dir", "pad": "'
    secret.write_text(head + "x" * (7777 - len(head) - 2) + '"}')
    data = secret.read_bytes()
    assert len(data) == 7777
    newest = step_dir(ckpt, 4)
    escapes = [os.path.relpath(secret, newest), str(secret)]          # "../../secret.json", absolute
    os.symlink(secret, newest / "config.json")                          # and a symlink out
    for rel in escapes + ["config.json"]:
        list_file(newest, rel, data)

    shown = cli("inspect", ckpt, "4", "--json", expect=None)
    assert "hunter2" not in shown.stdout + shown.stderr, "inspect printed a file from outside the step"
    assert "Traceback" not in shown.stderr, shown.stderr
    bad = cli("verify", ckpt, expect=1)
    assert "step 4: DAMAGED" in bad.stdout and "step 2: OK" in bad.stdout, bad.stdout
    assert "7777" not in bad.stdout and "7.6 KiB" not in bad.stdout, "verify reported the outside file's size"
    assert "Traceback" not in bad.stderr, bad.stderr
    listing = cli("ls", ckpt, "--json", expect=None)
    rows = {r["step"]: r for r in json.loads(listing.stdout)["checkpoints"]}
    assert rows[4]["state"] == "damaged" and not rows[4]["picked"] and rows[2]["picked"]

    # a plain inside name whose file is a symlink out (the model, moved out, same bytes): refused when read
    rewrite(newest, lambda m: [m["files"].pop(r) for r in escapes + ["config.json"]])
    os.unlink(newest / "config.json")
    shutil.move(newest / "model.safetensors", tmp_path / "model.safetensors")
    os.symlink(tmp_path / "model.safetensors", newest / "model.safetensors")
    step, ev = probe(ckpt, tmp_path)
    assert step == 2, "the loader followed a symlink out of the step"
    assert any(e["event"] == "error" and e.get("step") == 4 and "model.safetensors" in e.get("message", "")
               for e in ev), [e for e in ev if e["event"] == "error"]
    assert "outside the step" in cli("verify", ckpt, "4", expect=1).stdout


# ---- item 13: a malformed manifest rejects its step, loudly, and the job starts from the previous one ----

def _no_size(m):
    del m["files"]["model.safetensors"]["size"]


def _string_size(m):
    m["files"]["model.safetensors"]["size"] = str(m["files"]["model.safetensors"]["size"])


def _bad_algo(m):
    m["checksum"] = "md5"


def _negative_step(m):
    m["step"] = -4


@pytest.mark.parametrize("damage,field", [(_no_size, "size"), (_string_size, "size"), (_bad_algo, "checksum"),
                                          (_negative_step, "step"), ("invalid-json", "JSON")])
def test_a_malformed_manifest_is_rejected_logged_and_the_job_starts_from_the_previous_step(ckpt, tmp_path,
                                                                                           damage, field):
    from easyckpt.config import NAMINGS
    from easyckpt.storage.savedir import SaveDir
    newest = step_dir(ckpt, 4)
    if damage == "invalid-json":
        (newest / MANIFEST_NAME).write_text('{"format_version": 1, "step": 4, "files": {')
    else:
        rewrite(newest, damage)
    with pytest.raises(ManifestError, match=field):
        stepfiles.load(str(newest))
    assert stepfiles.read(str(newest)) is None
    assert [s for s, _ in SaveDir(str(ckpt), NAMINGS["pytorch"]).committed()] == [2]

    step, ev = probe(ckpt, tmp_path)
    assert step == 2, "the 2-rank job must start from the intact older step"
    rejected = [e for e in ev if e["event"] == "error" and e.get("step") == 4]
    assert rejected and rejected[0]["path"] == str(newest) and field in rejected[0]["message"], rejected

    for verb, *args, status in (("ls", 0), ("ls", "--verify", 1), ("verify", 1), ("inspect", "4", 1)):
        out = cli(verb, ckpt, *args, expect=status)
        assert "Traceback" not in out.stderr + out.stdout, out.stderr
        lines = [ln for ln in out.stdout.replace(str(ckpt), "CKPT").splitlines() if "manifest" in ln and field in ln]
        assert len(lines) == 1, f"easyckpt {verb} {' '.join(args)}: one readable line for the damaged step\n{out.stdout}"


# ---- item 17: messages say what differs, in readable units ------------------------------------------------

def test_size_and_checksum_messages_say_exactly_what_differs_in_readable_units(tmp_path):
    data = bytes(range(256)) * 19        # 4864 bytes
    (tmp_path / "a.bin").write_bytes(data[:4676])
    (tmp_path / "b.bin").write_bytes(data[:-1] + b"\x00")
    man = mf.build(1, "job", "pytorch", 1, {"a.bin": mf.FileEntry(len(data), mf.checksum(data)),
                                             "b.bin": mf.FileEntry(len(data), mf.checksum(data))})
    size_msg = stepfiles.verify_file(str(tmp_path), "a.bin", man)
    assert "4.6 KiB (4676 bytes)" in size_msg and "4.8 KiB (4864 bytes)" in size_msg, size_msg
    assert "188 bytes short" in size_msg, size_msg
    assert stepfiles.check_sizes(str(tmp_path), man, ["a.bin"]) == [size_msg]
    sum_msg = stepfiles.verify_file(str(tmp_path), "b.bin", man)
    assert mf.checksum(data[:-1] + b"\x00") in sum_msg and mf.checksum(data) in sum_msg, sum_msg
    assert "corrupted" in sum_msg and "4864 bytes" in sum_msg
    # a size recorded as a string used to print "size 4864 != 4864": now the manifest itself is refused
    raw = man.to_json()
    raw["files"]["a.bin"]["size"] = str(len(data))
    with pytest.raises(ManifestError, match=r"files\['a.bin'\].size is '4864', expected an integer"):
        mf.validate(raw)


def test_a_file_far_larger_than_its_manifest_entry_is_refused_before_a_buffer_is_made_for_it(tmp_path):
    # a sparse 1 TiB file where the manifest lists 16 bytes: reading it whole first would need 1 TiB of memory
    data = b"0123456789abcdef"
    with open(tmp_path / "big.bin", "wb") as f:
        f.write(data)
        f.truncate(1 << 40)
    man = mf.build(1, "job", "pytorch", 1, {"big.bin": mf.FileEntry(len(data), mf.checksum(data))})
    with pytest.raises(ManifestError, match="too long"):
        stepfiles.read_verified(str(tmp_path), "big.bin", man)
    with pytest.raises(ManifestError, match="too long"):
        stepfiles.read_entry_hashed(str(tmp_path), "big.bin", man.algo, expect=len(data))


def test_shm_capacity_message_names_a_small_shortfall_in_readable_units(monkeypatch):
    from easyckpt.engine.save import snapshot
    from easyckpt.errors import ShmCapacityError
    from easyckpt.ipc import shm
    monkeypatch.setattr(shm, "free_bytes", lambda: 1000)     # /dev/shm with 1000 bytes left
    snap = snapshot.Snapshotter("0badc0ffee00", rank=0, world_size=1)
    try:
        with pytest.raises(ShmCapacityError) as err:
            snap.snapshot(1, [snapshot.ShardSpec("m.safetensors", {"w": torch.zeros(1024)}, True)], persist=False)
    finally:
        snap.close(unlink=True)
    msg = str(err.value)
    assert "0.00 GiB" not in msg and re.search(r"needs \d+(\.\d)? [KM]iB more", msg) and "1000 B" in msg, msg
    assert not [p for p in os.listdir(shm.SHM_DIR) if "0badc0ffee00" in p]


def test_every_easyckpt_error_about_a_manifest_is_one_base_class():
    assert issubclass(ManifestError, EasyCkptError) and issubclass(ManifestError, ValueError)


# ---- item 7: DeepSpeed's converters read only listed, verified files; a pickle never runs --------------

DS_TRAIN = ROOT / "examples" / "deepspeed" / "train.py"


class _Marker:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _evil_pickle(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"module": {"w": torch.ones(2)}, "buffer_names": [], "param_shapes": [], "payload": _Marker(str(marker))},
               buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def ds_zero2(tmp_path_factory) -> Path:
    """DeepSpeed ZeRO-2 on 2 ranks, steps 2 and 4 committed."""
    d = tmp_path_factory.mktemp("ds-trust")
    run(script_cmd(DS_TRAIN, 2, "--save-dir", str(d / "ckpt"), "--zero", "2", "--iters", "4", "--storage-interval",
                   "2", "--dropout", "0", "--idle-timeout", "1", torchrun=True), timeout=300)
    wait_no_agent(d / "ckpt")
    return d / "ckpt"


@pytest.mark.parametrize("variant", ["unlisted", "listed"])
def test_deepspeed_conversions_read_only_listed_files_and_never_run_a_pickle(tmp_path, ds_zero2, variant):
    ckpt = Path(shutil.copytree(ds_zero2, tmp_path / "ckpt"))
    marker = tmp_path / "pwned"
    newest = ckpt / "global_step4"
    # a file DeepSpeed's tools glob for: a second model-parallel rank's states
    planted = "mp_rank_01_model_states.pt"
    (newest / planted).write_bytes(_evil_pickle(marker))
    if variant == "listed":
        list_file(newest, planted, (newest / planted).read_bytes(), fmt="torch")

    # `easyckpt convert`: the listed pickle is refused; the unlisted one is never read
    out = tmp_path / "out.safetensors"
    done = cli("convert", "safetensors", ckpt, "4", "--output", out, expect=None)    # main(argv), in this process
    assert not marker.exists(), "convert ran a pickle from the checkpoint"
    if variant == "listed":
        assert done.returncode == 1 and planted in done.stderr, done.stderr[-2000:]
    else:
        assert done.returncode == 0, done.stderr[-2000:]

    # resuming on 1 rank goes through DeepSpeed's universal converter
    log = tmp_path / "resume.jsonl"
    run(script_cmd(DS_TRAIN, 1, "--save-dir", str(ckpt), "--zero", "2", "--iters", "6", "--storage-interval", "2",
                   "--dropout", "0", "--idle-timeout", "1", "--log-file", str(log), torchrun=True), timeout=300)
    wait_no_agent(ckpt)
    assert not marker.exists(), "the universal conversion ran a pickle from the checkpoint"
    ev = events(log)
    loads = [e for e in ev if e["event"] == "load"]
    converted = [e for e in ev if e["event"] == "convert"]
    assert converted, "the resume on another data-parallel size did not convert"
    # unlisted: never read, step 4 resumes; listed: the loader's safe unpickling rejects step 4
    assert loads[0]["step"] == (4 if variant == "unlisted" else 2), loads
    assert not list(ckpt.glob(".easyckpt-universal-*")), "the converted copy was not removed"
