"""Shared helpers for the engine tests: small deterministic training states and equality checks."""

import os
import random
import socket
import sys
import tempfile
from multiprocessing.connection import Connection

# Keep hypothesis's example database out of the working tree.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(tempfile.gettempdir(), "async_ckpt-hypothesis"))

import pytest
import torch
from hypothesis import settings

# The suite draws the same examples every run, so that a red run is a bug that reruns, never a new
# draw; HYPOTHESIS_PROFILE=explore draws anew (and keeps what fails in the database above).
settings.register_profile("suite", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/


_NOT_LEAKS = {"PYTEST_CURRENT_TEST",  # pytest's own
              "TORCHINDUCTOR_CACHE_DIR"}  # torch memoizes its cache directory the first time
"""Names that a test's process sets whatever the test does: never reported as a leak."""


def _put_back(environment: dict) -> list:
    """Make os.environ ``environment`` again; the names that had changed."""
    changed = sorted(k for k in set(environment) | set(os.environ)
                     if environment.get(k) != os.environ.get(k) and k not in _NOT_LEAKS)
    os.environ.clear()
    os.environ.update(environment)
    return changed


@pytest.fixture
def restored_environment():
    """For a test whose code under test writes os.environ by design (Lightning's fit: MASTER_PORT,
    LOCAL_RANK, NODE_RANK, its seed; ``deterministic()``: OMP_NUM_THREADS): put back after it."""
    before = dict(os.environ)
    yield
    _put_back(before)


@pytest.fixture(scope="module", autouse=True)
def the_worker_left_as_found(request):
    """Each test file leaves its worker process as it found it: the same environment, and no
    process group. A file that changed them (frameworks write RANK, WORLD_SIZE, LOCAL_RANK or
    MASTER_PORT into os.environ when they set up ranks; Lightning keeps its one-rank group after
    a fit) would change what a later file in the same xdist worker sees: its subprocesses
    inherit the environment and take themselves for ranks of a distributed job (Lightning's
    ModelParallelStrategy leaves LOCAL_RANK=0: a later Accelerator wrapped its model in DDP). Put
    back, and reported as a warning naming the file, so that the leak is fixed where it happens
    (``restored_environment``)."""
    before = dict(os.environ)
    yield
    group = torch.distributed.is_available() and torch.distributed.is_initialized()
    if group:
        torch.distributed.destroy_process_group()
    changed = _put_back(before)
    if changed or group:
        import warnings
        warnings.warn(f"{request.module.__name__} left {'a process group and ' if group else ''}"
                      f"the environment changed: {changed}", pytest.PytestWarning)


def make_training_state(seed: int = 0, width: int = 32):
    """A model, an AdamW optimizer with state, and a scheduler, after one real step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    train_step(model, optimizer, scheduler)
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler=None):
    loss = model(torch.randn(8, model[0].in_features)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if scheduler is not None:
        scheduler.step()
    return loss.item()


def assert_same(a, b, path="state"):
    """Bit-exact recursive equality of tensors (incl. dtype, shape, stride) and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and bit_equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, path
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    ab = a.contiguous().reshape(-1).view(torch.uint8) if a.dtype != torch.bool else a.to(torch.uint8)
    bb = b.contiguous().reshape(-1).view(torch.uint8) if b.dtype != torch.bool else b.to(torch.uint8)
    return torch.equal(ab, bb)


SEED_VARIABLE = "ASYNC_CKPT_TEST_SEED"


@pytest.fixture
def seeded_random(request) -> random.Random:
    """The random choices of a test that kills processes at random moments: seeded from
    $ASYNC_CKPT_TEST_SEED when set, else from a fresh seed each run (more moments over many runs).
    A failing test reports its seed (``pytest_runtest_makereport``), so the same choices can be
    made again; the processes' own timing still varies from run to run."""
    seed = int(os.environ.get(SEED_VARIABLE) or random.SystemRandom().randrange(1 << 32))
    request.node.user_properties.append((SEED_VARIABLE, seed))
    return random.Random(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Adds the seed of a failed test that drew one (``seeded_random``) to its report."""
    report = (yield).get_result()
    if report.failed:
        for name, seed in item.user_properties:
            if name == SEED_VARIABLE:
                report.sections.append(("random choices", f"seed {seed}: rerun with "
                                        f"{SEED_VARIABLE}={seed} to make the same choices"))


class FakeClock:
    """A monotonic clock that moves only when the test advances it: the library's timeouts and
    measured waits, given this clock, without sleeping or bounding a test by the wall clock."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def ckpt_dir(tmp_path):
    return str(tmp_path / "ckpt")


@pytest.fixture
def fsynced(monkeypatch):
    """The directories ``storage.local.fsync_dir`` is called on (it still fsyncs them)."""
    from async_ckpt.storage import local

    calls = []
    real = local.fsync_dir

    def recording(path):
        calls.append(path)
        real(path)

    monkeypatch.setattr(local, "fsync_dir", recording)
    return calls


@pytest.fixture(scope="module")
def server():
    """A real S3-protocol server on loopback (tests/s3server.py: moto), one per test module;
    a test may kill it (a store that is down) and start it again."""
    from s3server import S3Server

    s3 = S3Server()
    s3.start()
    yield s3
    s3.kill()


def connected_writer(tmp_path, rank=0, world_size=1):
    """A writer process's state (``SnapshotWriter``) in this process, over ``tmp_path``, and the
    trainer's end of its connection: to drive the writer message by message."""
    from async_ckpt.write.protocol import WriterConfig
    from async_ckpt.write.writer import SnapshotWriter

    config = WriterConfig(root=str(tmp_path), rank=rank, world_size=world_size,
                          spread_replicated=False, reserve_bytes=0, compression=None, level=3,
                          keep_last=2, keep_every=None, commit_timeout=10.0, nice=0,
                          low_io_priority=False, lock=str(tmp_path / "lock"), log_level=30,
                          remote=None, remote_options=None, remote_keep_last=1, own_root=False,
                          direct_io=False)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Connection(ours.detach()), SnapshotWriter(Connection(theirs.detach()), config)
