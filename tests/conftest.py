import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Under pytest-xdist (the README's test command and .ci/run run the tiers with -n 2) every worker gets a shared-memory
# directory of its own, set before easyckpt is imported (ipc/shm.py reads it once): shm_clean's
# before/after comparison, the reaper of dead jobs' segments and the tests' planted segments then see
# only their own worker's segments.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and "EASYCKPT_SHM_DIR" not in os.environ:
    _SHM = Path("/dev/shm") / f"ectest-{os.getpid()}-{_WORKER}"
    _SHM.mkdir(mode=0o1777)
    os.chmod(_SHM, 0o1777)   # another local user (the `nobody` tests) creates segments there too
    os.environ["EASYCKPT_SHM_DIR"] = str(_SHM)
else:
    _SHM = None

# torchrun leaves a torchelastic_* directory in the temporary directory of every launch: the launched
# processes get one of this session's own, removed at its end, so a run leaves /tmp as it found it
_TMP = tempfile.mkdtemp(prefix="easyckpt-tests-")
_OWNER = os.getpid()
os.chmod(_TMP, 0o1777)   # as /tmp is: the tests that act as another local user (`nobody`) work in it too
os.environ["TMPDIR"] = _TMP

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402


def _remove_session_dirs():
    if os.getpid() != _OWNER:      # a forked child runs its parent's exit handlers: the directories are not its own
        return
    shutil.rmtree(_TMP, ignore_errors=True)
    if _SHM is not None:
        shutil.rmtree(_SHM, ignore_errors=True)


# at the interpreter's exit, not at pytest_sessionfinish: a run that stops before its session starts (a bad
# command-line option, after this file was imported) left an empty easyckpt-tests-* directory in /tmp each time
atexit.register(_remove_session_dirs)


# ---- how pytest-xdist shares the modules out (the README's command runs them on several workers) --------------

# The modules that take longest, longest first (their time in the default tier at bc64d35, --durations=0, this
# project's 2-core machine: the S3 modules 334 s together, the Trainer's 147 s, ... the Trainer's settings
# 19 s): handed out first, so that no worker starts a long module while the others run out of work. xdist's own
# order (by number of tests) handed out the Trainer's and DeepSpeed's few long tests last. The rest follow in
# collection order.
LONGEST_FIRST = ["test_s3", "test_store_gcs", "test_store_azure", "test_transformers", "test_megatron", "test_preemption", "test_deepspeed",
                 "test_many_nodes", "test_faults", "test_fsdp", "test_megatron_reshard", "test_trust",
                 "test_benchmark", "test_adopt", "test_manifest_trust", "test_planted", "test_shared_dir",
                 "test_fault_matrix", "test_run_order", "test_resume", "test_convert", "test_transformers_settings"]
# the modules of one S3 server (the s3_gateway fixture, once per worker): one scope, run on one worker
S3_MODULES = ("test_s3.py", "test_store_checkpoints.py", "test_s3_frameworks.py", "test_s3_benchmark.py")
# test_store_checkpoints' gs:// and az:// cases (ids ending [gcs] / [azure]): a scope each, so that they run beside
# the S3 modules on other workers, each worker starting its own emulator (under 3 s) instead of one worker all
OTHER_STORES = ("gcs", "azure")


def _scope(path: str) -> str:
    name = Path(path.split("::")[0]).name
    store = path.rsplit("[", 1)[-1].rstrip("]") if path.endswith("]") else ""
    if name == "test_store_checkpoints.py" and store in OTHER_STORES:
        return f"test_store_{store}"
    return "test_s3" if name in S3_MODULES else name[:-3]


# the longest end-to-end cases on gs:// and az:// go to the slow tier (their s3:// runs stay in the default one): the
# 30 s outage, FSDP2 and the reboot; the other gs:// and az:// cases added about 5 min on -n 2 (measured: 305 s)
SLOW_ON_OTHER_STORES = ("test_the_store_down_for_30_s", "test_fsdp2_killed_resumes", "test_after_a_reboot")


def pytest_collection_modifyitems(items):
    for item in items:
        if _scope(item.nodeid).startswith("test_store_") and item.name.startswith(SLOW_ON_OTHER_STORES):
            item.add_marker(pytest.mark.slow)
    rank = {scope: i for i, scope in enumerate(LONGEST_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(_scope(item.nodeid), len(rank)), order[id(item)]))


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile (pytest.ini), with the S3 modules as one scope and the modules handed out in the order
    collected (LONGEST_FIRST)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        def _split_scope(self, nodeid):
            scope = _scope(nodeid)
            return scope if scope == "test_s3" else super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return LongestFirst(config, log)


@pytest.fixture
def shared_dir():
    """A save dir as on a shared file system: mode 1777 (sticky), reachable by every local user (tests/test_planted.py,
    tests/test_shared_dir.py plant files in it as `nobody`)."""
    root = Path(tempfile.mkdtemp(prefix="easyckpt-shared-"))
    os.chmod(root, 0o755)
    save = root / "ckpt"
    save.mkdir()
    os.chmod(save, 0o1777)
    try:
        yield save
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def shm_clean():
    """Every test leaves /dev/shm as it found it: no easyckpt segment of its own may remain."""
    before = set(harness.shm_segments())
    yield
    after = set(harness.shm_segments()) - before
    assert not after, f"test left shared-memory segments behind: {sorted(after)}"


@pytest.fixture(autouse=True)
def fresh_console():
    """Each test starts with easyckpt's console as a new process has it (no handler, rank 0) and leaves it as it
    found it (inproc.fresh_console): a handler an earlier test's in-process job installed had its rank and
    stream, and test_replicas' console line went to another."""
    import inproc
    with inproc.fresh_console():
        yield


@pytest.fixture(autouse=True)
def s3_endpoint_restored():
    """Every test leaves the object-store endpoint as it found it. ``resolve.set_endpoint`` is process-wide (a
    job's setting, made by validating a Config or opening its SaveDir): test_config's unreachable endpoint
    (127.0.0.1:9) reached test_store_checkpoints' in-process CLI calls when a pytest-xdist worker ran both."""
    from easyckpt.storage import resolve
    before = resolve._endpoint
    yield
    resolve.set_endpoint(before)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(key, produce)``: ``produce(directory)``'s result (an uninterrupted run's losses), run
    once per session for each ``key`` and shared by every test that asks for the same run. A key names what
    decides the losses (the script, the layout, the flags that change training), never the checkpoint
    format: the format must not change training, so tests of both formats compare with one run."""
    cache = {}

    def get(key, produce):
        if key not in cache:
            cache[key] = produce(tmp_path_factory.mktemp("uninterrupted"))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """The session's fake-gcs-server (tests/stores.py, scripts/gcs-server.sh), started when a test first needs it."""
    import stores
    with stores.gcs_running(tmp_path_factory.mktemp("gcs") / "server") as values:
        yield values


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory):
    """The session's Azurite (tests/stores.py, scripts/azure-server.sh), started when a test first needs it."""
    import stores
    with stores.azure_running(tmp_path_factory.mktemp("azure") / "server") as values:
        yield values


@pytest.fixture(scope="session")
def s3_gateway(tmp_path_factory):
    """The session's S3 server (tests/s3server.py), started when a test first needs it and stopped at the end:
    one start (about 15 s) for every object-store module, not one per module."""
    import s3server
    port, mon_port = s3server.ports()
    with s3server.running(tmp_path_factory.mktemp("s3") / "server", port, mon_port) as values:
        yield values
