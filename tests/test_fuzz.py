"""Structured fuzzing of a REAL checkpoint: mutate a copy, read it every way there is, check the rule.

The rule, for any mutated checkpoint directory:

- every read (``async_ckpt.load``, ``CheckpointEngine.restore``) either raises a subclass of
  ``async_ckpt.errors.CheckpointError`` or returns data bit-identical to one of the committed
  snapshots (the newest, or the older one as a fallback; ``load(dir, step=1)`` only step 1);
- never another exception type, never a hang (SIGALRM after ``ASYNC_CKPT_FUZZ_HANG_S``), never a
  crash, never a deletion outside the checkpoint directory or of the directory itself, never code
  run from the file (a ``$pickle`` node that would create a directory);
- when ``restore()`` raises, the registered objects and the global generators are unchanged; when
  it succeeds they equal a committed snapshot bit for bit, the registered objects are still the
  ones registered, and every generator (``random``, ``numpy.random``, ``torch``, the registered
  ``torch.Generator`` and NumPy ``Generator``) can still draw (checked in a forked child, so a
  crafted state that crashes the process is reported, not fatal);
- every target's peak memory (VmHWM, reset before it) grows by at most 1.2x the bytes the
  mutation rightly asks to read (``Mutation.asked_bytes``) plus ``READ_ALLOWANCE``, and it takes
  at most ``SLOW_S`` seconds (issue 40; ``huge_counts`` makes counts and values huge);
- the command line (``cli.main([...])`` for ls, inspect, verify, export, gc --dry-run and a real
  gc) always returns an int exit code (0, 1 or 2): no exception escapes ``main()`` and nothing it
  prints holds a "Traceback".

Three exceptions to "bit-identical". ``load(mmap=True)`` checks no checksum (documented): it may
return damaged bytes where the same read with ``verify=True`` refuses them ("unverified damage").
An edit of a shard index's ``tree`` or ``tensors``, or of the
tensor bytes, with the checksums recomputed describes other, well-formed data (a different view,
value or generator state) that no reader can tell from the real thing: for those
(``Mutation.relaxed``) a successful read may return other data ("altered" in the counts);
everything else still holds. And the manifest has no checksum: when it was itself mutated (deleted,
emptied), ``restore()`` may return None (nothing committed) if it changed nothing ("none").

A module fixture writes each pristine checkpoint once (``fuzzing.build_pristine``: ``plain``, steps 1
raw and 2 with zstd, exercising the raw, zstd and planes codecs; ``incremental``, step 2 an
incremental snapshot whose shard refers to step 1's chunks, so that the references and the
manifest's ``refers`` are fuzzed too) and keeps its bytes in memory; every case
copies them into a fresh sandbox, applies ONE mutation (``fuzzing.MUTATION_KINDS``: byte flips,
truncation, shard-index JSON edits with trailer and manifest fixed up, manifest JSON edits,
files replaced by directories/FIFOs/symlinks or deleted, shards laid out again with storages off
their dtypes' alignment and tensors retyped to wide stride-0 views (``misaligned_view``), and chunk
data rewritten with checksums
fixed up: zstd frames replaced by bombs and broken frames, tensor bytes such as a generator's
state overwritten; for restore() also crafted generator states, ``rng_state``, and optimizer and
scheduler hyper-parameters of other types, ``hyper_parameter``) and runs the
targets. Each kind has its own load+CLI test and restore test (one engine per test function), so
one failing kind does not hide the others.

Run:

    python -m pytest -q tests/test_fuzz.py                    # CI: ~300 cases, fixed seed, ~40 s
    ASYNC_CKPT_FUZZ_CASES=12000 python -m pytest -q tests/test_fuzz.py   # long run, random seed:
                                      # >= 10,000 cases (file replacement runs out at 38 per test)
    ASYNC_CKPT_FUZZ_CASES=12000 ASYNC_CKPT_FUZZ_KEEP_GOING=1 ASYNC_CKPT_FUZZ_HANG_S=3 \
        python -m pytest -q tests/test_fuzz.py                # list every distinct failure

A failing case is shrunk by Hypothesis and reported with its mutation (``Falsifying example:
fuzz(mutation=IndexEdit(step2-shard: tensors[0].dtype = []))``) and a note per broken rule; an
exception that escaped the library is re-raised as is, so its traceback shows where it came from
and Hypothesis reports distinct bugs separately.

Environment:

- ``ASYNC_CKPT_FUZZ_CASES``: total cases across the 18 test functions and both pristine
  checkpoints (default 300); setting it
  also drops the fixed seed unless ``ASYNC_CKPT_FUZZ_SEED`` is set.
- ``ASYNC_CKPT_FUZZ_KEEP_GOING=1``: do not stop at the first failing case of a test; record every
  failure and fail the test at its end with the distinct failures (no shrinking). Best for a long
  run that should list every distinct bug.
- ``ASYNC_CKPT_FUZZ_HANG_S`` (default 10): seconds before a target counts as hung;
  ``ASYNC_CKPT_FUZZ_HANG_NEXT_S`` (default 2): the limit for the other targets of a case that
  already hung once (a FIFO hangs every target that opens it).
- ``ASYNC_CKPT_FUZZ_REPORT=path.json``: write the outcome counts and distinct failures there.
- ``ASYNC_CKPT_FUZZ_BREADCRUMB`` (default ``$TMPDIR/async_ckpt_fuzz_current_case.txt``): the case
  being run; after a hard crash of the test process it names the mutation (and holds the stacks
  faulthandler dumped if the process got stuck in C code).

The counts (typed error / clean / fallback / altered per target, exit codes per command) and the
distinct failures (rule, exception type, target, file:function, shortest mutation) are printed at
the end of the module; with ``--hypothesis-show-statistics`` Hypothesis also shows them per test.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import tempfile
import time

import pytest
import torch
from hypothesis import HealthCheck, event, given, seed, settings

import async_ckpt
import fuzzing as fz
from async_ckpt.format.values import READ_ALLOWANCE
from memory_cases import peak_added, reset_peak
from async_ckpt import CheckpointEngine
from async_ckpt.tools import cli
from async_ckpt.errors import CheckpointError
from async_ckpt.format.manifest import read_manifest
from async_ckpt.storage.local import LocalStorage

TOTAL_CASES = int(os.environ.get("ASYNC_CKPT_FUZZ_CASES", "300"))
LONG_RUN = "ASYNC_CKPT_FUZZ_CASES" in os.environ
SEED = os.environ.get("ASYNC_CKPT_FUZZ_SEED")
CI_SEED = 20240607
KEEP_GOING = os.environ.get("ASYNC_CKPT_FUZZ_KEEP_GOING", "") not in ("", "0")
HANG_S = float(os.environ.get("ASYNC_CKPT_FUZZ_HANG_S", "10"))
HANG_NEXT_S = float(os.environ.get("ASYNC_CKPT_FUZZ_HANG_NEXT_S", "2"))
SLOW_S = 10  # issue 40: no read takes longer, but in proportion to the bytes asked for
REPORT = os.environ.get("ASYNC_CKPT_FUZZ_REPORT")
BREADCRUMB = os.environ.get("ASYNC_CKPT_FUZZ_BREADCRUMB",
                            os.path.join(tempfile.gettempdir(), "async_ckpt_fuzz_current_case.txt"))
RESTORE_KINDS = fz.MUTATION_KINDS + fz.RESTORE_ONLY_KINDS
CASES_PER_TEST = max(1, TOTAL_CASES // ((len(fz.MUTATION_KINDS) + len(RESTORE_KINDS))
                                        * len(fz.PRISTINES)))

# Command lines run on every mutated directory (DIR and OUT are filled in), in this order; the
# real gc runs last, then load() once more on what it left. (`main()` builds its whole parser on
# every call, so each command line costs ~10 ms: the list is what covers distinct code paths.)
CLI_READ = [["ls"], ["ls", "--json"], ["inspect"], ["inspect", "--step", "1"], ["verify", "--all"],
            ["export", "--step", "2", "--to", "OUT/all.pt"],
            ["export", "--step", "1", "--only", "model", "--to", "OUT/model.safetensors"],
            ["gc", "--keep-last", "1", "--dry-run"]]
CLI_GC = [["gc"], ["gc", "--keep-last", "1"]]
VERIFY_ALL = ["verify", "--all"]
assert VERIFY_ALL in CLI_READ and CLI_READ.index(VERIFY_ALL) < CLI_READ.index(["gc", "--keep-last",
                                                                              "1", "--dry-run"])


def fuzz_settings(test):
    test = settings(max_examples=CASES_PER_TEST, deadline=None, database=None,
                    report_multiple_bugs=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much,
                                           HealthCheck.large_base_example])(test)
    if SEED is not None:
        return seed(int(SEED))(test)
    return test if LONG_RUN else seed(CI_SEED)(test)


# --- failures, raised so that Hypothesis tells distinct bugs apart and shrinks each -------------


class FuzzFailure(AssertionError):
    """A broken rule that is not an exception escaping the library."""


class WrongData(FuzzFailure):
    pass


class ObjectsChanged(FuzzFailure):
    pass


class StrayDeletion(FuzzFailure):
    pass


class CodeExecuted(FuzzFailure):
    pass


class Hang(FuzzFailure):
    pass


class DrawFailed(FuzzFailure):
    pass


class BadCliExit(FuzzFailure):
    pass


class VerifyDisagrees(FuzzFailure):
    pass


class MemoryBound(FuzzFailure):
    pass


_RULE_ERRORS = {"wrong data": WrongData, "objects changed on error": ObjectsChanged,
                "registered object replaced": ObjectsChanged, "stray deletion": StrayDeletion,
                "checkpoint dir deleted": StrayDeletion, "code from the file ran": CodeExecuted,
                "hang": Hang, "rng draw after restore": DrawFailed, "cli exit code": BadCliExit,
                "objects unusable after restore()": ObjectsChanged,
                "cli printed a traceback": BadCliExit, "memory bound": MemoryBound,
                "slow": Hang, "verify disagrees with load": VerifyDisagrees}


class Case:
    """One mutated directory and the failures its targets showed."""

    def __init__(self, test: str, mutation: fz.Mutation, sandbox: fz.Sandbox, log: fz.FuzzLog):
        self.test, self.mutation, self.sandbox, self.log = test, mutation, sandbox, log
        self.failures: list[fz.Failure] = []
        self.hung = False
        self.seen_problems: set[str] = set()

    def fail(self, rule: str, target: str, message: str, exc=None, where: str = "") -> None:
        self.failures.append(fz.Failure(rule, target, message, where, exc))

    def call(self, target: str, fn, typed_ok: bool = True):
        """Run one target under the hang guard: ("ok", value), ("error", CheckpointError) or
        ("failed", None) when it broke a rule (recorded)."""
        limit = HANG_NEXT_S if self.hung else HANG_S
        base, start = reset_peak(), time.perf_counter()
        try:
            try:
                with fz.hang_guard(limit, target):
                    return "ok", fn()
            except CheckpointError as e:
                if typed_ok:
                    return "error", e
                raise
        except fz.FuzzHang as e:
            self.hung = True
            self.fail("hang", target, str(e), e, fz.where_raised(e))
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - any other exception breaks the rule
            message = " ".join(f"{type(e).__name__}: {_clip(fz.safe_str(e))}".split())
            self.fail("untyped exception", target, message, e, fz.where_raised(e))
        finally:
            self.check_sandbox(target)
            self.check_cost(target, peak_added(base), time.perf_counter() - start)
        return "failed", None

    def check_cost(self, target: str, peak: int, seconds: float) -> None:
        """Issue 40: a read takes at most 1.2x the bytes it may rightly read, plus the fixed
        allowance, and no more than SLOW_S seconds (the pristine's bytes are a few KiB)."""
        self.log.cost(target, peak, seconds, self.mutation)
        bound = int(1.2 * self.mutation.asked_bytes) + READ_ALLOWANCE
        if peak > bound:
            self.fail("memory bound", target, f"peak memory grew by {peak >> 20} MiB, more than "
                      f"the {bound >> 20} MiB allowed")
        if seconds > SLOW_S:
            self.fail("slow", target, f"took {seconds:.1f} s")

    def check_sandbox(self, target: str) -> None:
        for rule, problem in self.sandbox.problems():
            if problem not in self.seen_problems:
                self.seen_problems.add(problem)
                self.fail(rule, target, problem)

    def finish(self) -> None:
        self.log.cases[self.test] += 1
        for f in self.failures:
            self.log.failure(self.test, f, self.mutation)
            event(f"FAILED {f.rule}: {fz._target_group(f.target)}")
        if not self.failures or KEEP_GOING:
            return
        notes = [f"mutation: {self.mutation!r}"] + [f"failure: {f}" for f in self.failures]
        first = self.failures[0]
        if first.rule == "untyped exception":
            exc = first.exc  # re-raised as is: Hypothesis groups failures by where they came from
        else:
            exc = _RULE_ERRORS[first.rule](str(first))
        for note in notes:
            exc.add_note(note)
        if exc is first.exc:
            raise exc
        raise exc from first.exc


def _clip(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[:n] + f"...<{len(text)} chars>"


def check_keep_going(log: fz.FuzzLog, test: str) -> None:
    found = log.failures_of(test)
    if KEEP_GOING and found:
        lines = [f"[{f['rule']}] {f['exception']} in {f['target']} at {f['where'] or '-'} "
                 f"(x{f['count']}), e.g. {f['mutation']}: {f['message'][:200]}" for f in found]
        pytest.fail(f"{len(found)} distinct failures in {test}:\n" + "\n".join(lines), pytrace=False)


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def log(request):
    """The outcome counts, printed (and written to ASYNC_CKPT_FUZZ_REPORT) at the end. The
    library's warnings (one per fallback) are silenced meanwhile: they would bury the report."""
    log = fz.FuzzLog()
    logger = logging.getLogger("async_ckpt")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield log
    finally:
        logger.setLevel(level)
    summary = log.summary()
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\n" + summary)
    if REPORT:
        with open(REPORT, "w") as f:
            json.dump(log.to_json(), f, indent=1, default=str)


@pytest.fixture(scope="module", params=fz.PRISTINES)
def pristine(tmp_path_factory, request):
    p = fz.build_pristine(str(tmp_path_factory.mktemp("pristine") / "ckpt"), request.param)
    # Self-test of the rewriting helpers: each index rewritten unchanged, each zstd payload
    # recompressed to the same bytes, and each storage re-encoded unchanged (planes as raw), with
    # every checksum fixed up, must still load exactly; a snapshot whose references point into
    # a rewritten shard must refuse it instead (references pin the target's index checksum).
    root = str(tmp_path_factory.mktemp("selftest"))
    referring = {shard.step: {shard.index["storages"][i]["ref"]["dir"]
                              for i in fz.referring_storages(shard)} for shard in p.shards.values()}
    same_data = [fz.ChunkPayload(*where, "recompress_same") for where in sorted(p.decoded)]
    same_data += [fz.TensorBytes(alias, si, 0, 0, 0) for alias, shard in p.shards.items()
                  for si in fz.stored_storages(shard)]
    for what in list(p.shards) + same_data:
        sandbox = fz.Sandbox(root)
        p.write(sandbox.ckpt)
        if what in p.shards:
            shard = p.shard_by_alias(what)
            data, digest = fz.rewrite_shard(shard.prefix, fz.index_bytes(shard.index))
            fz._write(os.path.join(sandbox.ckpt, shard.relpath), data)
            fz._write(os.path.join(sandbox.ckpt, fz.MANIFEST),
                      fz.manifest_bytes(fz.fix_manifest(p.manifest, shard.dir, len(data), digest)))
        else:
            what.apply(p, sandbox.ckpt, sandbox.ctx)
        rewritten = p.shard_by_alias(what if what in p.shards else what.shard).dir
        with open(os.path.join(sandbox.ckpt, fz.MANIFEST)) as f:
            now = {r["dir"]: r["shards"][0]["index_xxh3"] for r in json.load(f)["snapshots"]}
        index_changed = now[rewritten] != next(r["shards"][0]["index_xxh3"] for r in
                                               p.manifest["snapshots"] if r["dir"] == rewritten)
        for step in fz.STEPS:
            if rewritten in referring[step] and index_changed:
                with pytest.raises(CheckpointError):
                    async_ckpt.load(sandbox.ckpt, step=step)
                continue
            got = async_ckpt.load(sandbox.ckpt, step=step)
            assert fz.diff(got, p.refs[step]) is None, f"harness self-test failed for {what!r}"
        sandbox.close()
    return p


@pytest.fixture(scope="module")
def sandbox_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fuzz-cases"))


# --- load() and the command line -----------------------------------------------------------------


def check_load(case: Case, target: str, result: tuple, allowed: tuple, refs: dict,
               verified=None) -> str:
    """The outcome of a load() call: error:<type>, clean, fallback, altered, unverified damage,
    or failed. ``verified``: the same read with its checksums checked, for a call that checks
    none (``load(mmap=True)``, as documented): its damaged bytes are allowed where that read
    refuses them."""
    kind, value = result
    if kind == "error":
        return f"error:{type(value).__name__}"
    if kind == "failed":
        return "failed"
    if not (isinstance(value, tuple) and len(value) == 2):
        case.fail("wrong data", target, f"returned {type(value).__name__}, not (step, state)")
        return "failed"
    step, state = value
    if step not in allowed:
        case.fail("wrong data", target, f"returned step {step!r}; only {list(allowed)} may come back")
        return "failed"
    d = fz.diff(state, refs[step][1])
    if d is not None:
        if case.mutation.relaxed:
            return "altered"
        if verified is not None:
            kind, value = case.call(f"{target}, verified", verified)
            if (kind == "error" and value.is_damage) or (kind == "ok" and value[0] != step):
                return "unverified damage"
        case.fail("wrong data", target, f"returned step {step} but not its committed data: {d}")
        return "failed"
    return "clean" if step == allowed[0] else "fallback"


def check_verify_agrees(case: Case, loaded: dict) -> None:
    """``verify --all`` found every committed snapshot intact: then no load() of ``loaded``
    (target -> ``case.call``'s result) may find one damaged (verify says which step restore()
    picks; a disagreement misleads the operator)."""
    for target, (kind, value) in loaded.items():
        if kind == "error" and value.is_damage:
            case.fail("verify disagrees with load", "cli verify --all",
                      f"exit 0, but {target} raised {type(value).__name__}: {_clip(str(value))}")
    committed = read_manifest(LocalStorage(case.sandbox.ckpt)).newest_first()
    kind, value = loaded["load(dir)"]
    if kind == "ok" and committed and value[0] != committed[0].step:  # it fell back: it found the newest damaged
        case.fail("verify disagrees with load", "cli verify --all",
                  f"exit 0, but load(dir) fell back from step {committed[0].step} to step "
                  f"{value[0]}")


def run_cli(case: Case, words: list[str]) -> str:
    sandbox = case.sandbox
    argv = [words[0], sandbox.ckpt] + [w.replace("OUT", sandbox.out) for w in words[1:]]
    target = "cli " + " ".join([words[0], "DIR"] + words[1:])
    out, err = io.StringIO(), io.StringIO()

    def go():
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return cli.main(argv)

    kind, code = case.call(target, go, typed_ok=False)
    if kind != "ok":
        return "failed"
    if type(code) is not int or code not in (0, 1, 2):
        case.fail("cli exit code", target, f"main() returned {code!r}, not an exit code 0, 1 or 2")
        return "failed"
    printed = out.getvalue() + err.getvalue()
    if "Traceback" in printed:
        case.fail("cli printed a traceback", target, _clip(err.getvalue() or out.getvalue(), 600))
        return "failed"
    return f"exit:{code}"


def _cloned(loaded: tuple) -> tuple:
    """``load()``'s result with every tensor cloned: what torch's kernels do with a mapped view
    (a misaligned one crashed them, issue 40)."""
    step, state = loaded

    def clone(v):  # in place: the containers keep their types (a module state's _metadata)
        if isinstance(v, torch.Tensor):  # a corner of the view, where the tensor is huge
            # (a crafted stride-0 one): the kernels see the same address, the copy stays small
            return v.clone() if v.numel() <= 2**20 else v[(slice(0, 2),) * v.dim()].clone()
        if isinstance(v, (dict, list)):
            for k in (v if isinstance(v, dict) else range(len(v))):
                v[k] = clone(v[k])
        return v

    return step, clone(state)


def run_load_cli_case(test: str, mutation: fz.Mutation, p: fz.Pristine, log: fz.FuzzLog,
                      sandbox_root: str) -> None:
    sandbox = fz.Sandbox(sandbox_root)
    case = Case(test, mutation, sandbox, log)
    root = sandbox.ckpt
    try:
        with fz.crash_breadcrumb(BREADCRUMB, f"{test}: {mutation!r}", 30 * HANG_S + 60):
            p.write(root)
            mutation.apply(p, root, sandbox.ctx)
            loaded = {}
            for target, fn, allowed, verified in (
                    ("load(dir)", lambda: async_ckpt.load(root), (2, 1), None),
                    ("load(dir, step=1)", lambda: async_ckpt.load(root, step=1), (1,), None),
                    ("load(dir, mmap=True), every tensor cloned",
                     lambda: _cloned(async_ckpt.load(root, mmap=True)), (2, 1),
                     lambda: async_ckpt.load(root, mmap=True, verify=True))):
                loaded[target] = case.call(target, fn)
                outcome = check_load(case, target, loaded[target], allowed, p.refs, verified)
                log.outcome(test, target, outcome)
                event(f"{target}: {outcome}")
            for words in CLI_READ + CLI_GC:
                outcome = run_cli(case, words)
                log.outcome(test, "cli " + " ".join(words[:1]), outcome)
                if words == VERIFY_ALL and outcome == "exit:0":
                    check_verify_agrees(case, loaded)
            target = "load(dir) after a real gc"
            outcome = check_load(case, target, case.call(target, lambda: async_ckpt.load(root)),
                                 (2, 1), p.refs)
            log.outcome(test, target, outcome)
    finally:
        sandbox.close()
    case.finish()


def test_an_unverified_mapped_read_may_serve_a_damaged_chunk_that_a_verified_read_refuses(
        tmp_path):
    """Found by a 3000-case run: ``load(mmap=True)`` checks no checksum, as documented (pages are
    read when touched), so one flipped byte of a raw chunk comes back; the rule is that a read of
    the same mapping with ``verify=True`` refuses it, and so does ``load()``."""
    p = fz.build_pristine(str(tmp_path / "pristine"), "plain")
    root = str(tmp_path / "ckpt")
    p.write(root)
    fz.ByteFlip("step2-shard", ((64, 0x01),)).apply(p, root, None)
    step, state = async_ckpt.load(root, mmap=True)
    assert step == 2 and fz.diff(state, p.refs[2][1]) is not None
    with pytest.warns(RuntimeWarning, match="storage 0 chunk 0 fails its checksum"):
        assert async_ckpt.load(root, mmap=True, verify=True)[0] == 1
    with pytest.warns(RuntimeWarning, match="storage 0 chunk 0 fails its checksum"):
        assert async_ckpt.load(root)[0] == 1


@pytest.mark.parametrize("kind", fz.MUTATION_KINDS)
def test_load_and_cli(kind, pristine, log, sandbox_root):
    test = f"load_cli[{kind}]"

    @fuzz_settings
    @given(mutation=fz.mutation_strategy(pristine, kind))
    def fuzz(mutation):
        run_load_cli_case(test, mutation, pristine, log, sandbox_root)

    fuzz()
    check_keep_going(log, test)


# --- restore() into live objects -------------------------------------------------------------------


class LiveState:
    """The registered state of the restore tests and a way back to a known state after a case."""

    REGISTERED_EXTRA = ("zeros", "pattern")  # tensors in extra: copied into, never replaced

    def __init__(self):
        self.state = fz.make_state(seed=123)
        self.handles = dict(self.state)
        self.extra_keys = list(self.state["extra"])
        self.extra_tensors = {k: self.state["extra"][k] for k in self.REGISTERED_EXTRA}

    def replaced(self) -> list[str]:
        """Registered objects that restore() swapped for something else."""
        found = [k for k, v in self.handles.items() if self.state.get(k) is not v]
        extra = self.handles["extra"]
        found += [f"extra.{k}" for k, v in self.extra_tensors.items() if extra.get(k) is not v]
        return found

    def put_back(self) -> None:
        self.state.clear()
        self.state.update(self.handles)
        extra = self.handles["extra"]
        for k in list(extra):
            if k not in self.extra_keys:
                del extra[k]
        extra.update(self.extra_tensors)

    def renew(self) -> None:
        """Fresh objects in the same (registered) mapping, after a case left the old ones broken."""
        fresh = LiveState()
        self.state.clear()
        self.state.update(fresh.state)
        self.handles, self.extra_tensors = fresh.handles, fresh.extra_tensors


def run_restore_case(test, mutation, p, log, sandbox, engine, live, fps):
    is_lock = lambda name: os.path.basename(name).startswith(".lock-rank")  # noqa: E731 - held by the engine
    case = Case(test, mutation, sandbox, log)
    with fz.crash_breadcrumb(BREADCRUMB, f"{test}: {mutation!r}", 30 * HANG_S + 60):
        sandbox.reset_ckpt(keep=is_lock)
        p.write(sandbox.ckpt, skip=is_lock)
        mutation.apply(p, sandbox.ckpt, sandbox.ctx)
        before = fz.live_fingerprint(live.handles)
        kind, value = case.call("restore()", engine.restore)
        try:
            after = fz.live_fingerprint(live.handles)
        except Exception as e:  # noqa: BLE001 - the objects cannot even report their state
            case.fail("untyped exception", "state_dict() after restore()",
                      f"{type(e).__name__}: {_clip(fz.safe_str(e))}", e, fz.where_raised(e))
            after = None
        outcome = "failed"
        if kind == "error":
            outcome = f"error:{type(value).__name__}"
            d = after and fz.diff(after, before)
            if d:
                case.fail("objects changed on error", "restore()",
                          f"{type(value).__name__} was raised, but the objects changed: {d}")
        elif kind == "ok" and after is not None:
            if value is None:
                outcome = "none"
                if not mutation.manifest_level:
                    case.fail("wrong data", "restore()", "returned None (nothing committed) for "
                              "a directory whose manifest is intact")
                d = fz.diff(after, before)
                if d:
                    case.fail("wrong data", "restore()", f"returned None but changed the objects: {d}")
            elif value in fps:
                d = fz.diff(after, fps[value])
                if d is None:
                    outcome = "clean" if value == 2 else "fallback"
                elif mutation.relaxed:
                    outcome = "altered"
                else:
                    case.fail("wrong data", "restore()",
                              f"returned step {value} but the objects differ from it: {d}")
            else:
                case.fail("wrong data", "restore()", f"returned {value!r}, not a committed step")
            if live.replaced():
                case.fail("registered object replaced", "restore()",
                          f"restore() replaced registered objects {live.replaced()} instead of "
                          "loading into them")
        log.outcome(test, "restore()", outcome)
        event(f"restore(): {outcome}")
        # Draw from every generator. A state bit-identical to one already drawn from (before
        # the case, or a committed snapshot's) draws in-process; any other state, possibly
        # crafted, in a forked child, so that a crash is reported instead of ending the run.
        known = after is not None and any(fz.diff(after, good) is None
                                           for good in (before, *fps.values()))
        problem = (fz.draw_here(fz.rng_draws(live.handles)) if known
                   else fz.draw_in_child(fz.rng_draws(live.handles), HANG_S))
        if problem:
            case.fail("rng draw after restore", "draw after restore()", problem)
        log.outcome(test, "draws after restore()", "failed" if problem else "ok")
        # Back to a known state, so that the next case starts from the newest snapshot.
        live.put_back()
        sandbox.repair()
        sandbox.reset_ckpt(keep=is_lock)
        p.write(sandbox.ckpt, skip=is_lock)
        if not reset_to_newest(engine, live, fps):
            case.fail("objects unusable after restore()", "restore() of the pristine checkpoint",
                      "after this case, restoring the intact checkpoint no longer brings the "
                      "registered objects back to step 2 (fresh objects were registered instead)")
            live.renew()
            assert reset_to_newest(engine, live, fps), "harness: cannot restore the pristine checkpoint"
    case.finish()


def reset_to_newest(engine, live: LiveState, fps: dict) -> bool:
    try:
        with fz.hang_guard(HANG_S, "restore() of the pristine checkpoint"):
            restored = engine.restore()
        return restored == 2 and fz.diff(fz.live_fingerprint(live.handles), fps[2]) is None
    except (Exception, fz.FuzzHang):  # noqa: BLE001 - reported by the caller
        return False


@pytest.mark.parametrize("kind", RESTORE_KINDS)
def test_restore(kind, pristine, log, sandbox_root):
    test = f"restore[{kind}]"
    sandbox = fz.Sandbox(sandbox_root)
    pristine.write(sandbox.ckpt)
    live = LiveState()
    engine = CheckpointEngine(sandbox.ckpt, live.state, heartbeat_interval=None)
    try:
        fps = {}
        for step in fz.STEPS:
            assert engine.restore(step=step) == step
            fps[step] = fz.live_fingerprint(live.handles)
        assert fz.diff(fps[1], fps[2]) is not None
        assert engine.restore() == 2

        @fuzz_settings
        @given(mutation=fz.mutation_strategy(pristine, kind))
        def fuzz(mutation):
            run_restore_case(test, mutation, pristine, log, sandbox, engine, live, fps)

        fuzz()
    finally:
        try:
            engine.close()
        finally:
            sandbox.close()
    check_keep_going(log, test)
