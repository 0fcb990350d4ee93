"""EngineOptions: every engine setting's default, resolution and validation, in one place."""

import dataclasses
import inspect
import pickle
import signal
import threading

import pytest
import torch

from async_ckpt import CheckpointEngine
from async_ckpt.errors import InvalidArgumentError
from async_ckpt.format.tree import RNG_KEY
from async_ckpt.options import DEFAULT_PREEMPTION_SIGNALS, EngineOptions
from async_ckpt.write.protocol import WriterConfig

SETTINGS = [f.name for f in dataclasses.fields(EngineOptions)]


def test_defaults_are_resolved_at_construction_and_the_settings_kept_as_given():
    options = EngineOptions()
    assert (options.resolved.rank, options.resolved.world_size) == (0, 1)
    assert options.resolved.writer_nice == 10  # async mode leaves the CPU to training
    assert EngineOptions(mode="sync").resolved.writer_nice == 0
    assert EngineOptions(writer_nice=3).resolved.writer_nice == 3
    assert options.resolved.replicated == frozenset() and options.resolved.preemption == ()
    assert options.resolved.remote_keep_last == options.keep_last
    assert (options.rank, options.writer_nice, options.preemption) == (None, None, False)


def test_replicated_and_preemption_are_normalised():
    assert EngineOptions(replicated="model").resolved.replicated == frozenset({"model"})
    assert EngineOptions(replicated=["a", "b", "a"]).resolved.replicated == frozenset({"a", "b"})
    assert EngineOptions(preemption=True).resolved.preemption == DEFAULT_PREEMPTION_SIGNALS
    assert EngineOptions(preemption=[signal.SIGUSR2]).resolved.preemption == (signal.SIGUSR2,)
    assert EngineOptions(preemption=None).resolved.preemption == ()


def test_every_setting_is_declared_with_its_rule():
    for field in dataclasses.fields(EngineOptions):
        ok, expected = field.metadata["rule"]
        assert ok(field.default) and expected, field.name  # the default passes its own rule


# Refused values, setting by setting: each an InvalidArgumentError naming the setting and value.
REFUSED = {
    "mode": ["fast", None], "staging": ["later"], "copy_nice": [-1, 20, 2.5, None],
    "every": [0, 1.5, True, "2"],
    "memory_every": [0, 1.5, True], "memory_idle_timeout": [0, -1, None, float("nan"), float("inf")],
    "keep_last": [0, None], "keep_every": [0, 2.0], "slots": [0, -1, 1.0, False],
    "when_busy": ["drop"], "compression": ["lz4", "ZSTD", "", "gzip", True, 1], "level": [23, 1.5, None, True],
    "allow_pickle": [1, "yes", None, [object()], [pickle.loads]], "rng": [0], "rank": [-1, 0.0, "0"], "world_size": [0],
    "replicated": [3, ["a", 1], {"a": 1}, (n for n in "ab")], "spread_replicated": [None],
    "commit_timeout": [0, -1, float("nan"), "60"], "writer_nice": [-1, 20, 2.5],
    "writer_low_io": [1], "reserve_bytes": [-1, 1.5, "1G"],
    "lock_timeout": [-1, float("nan"), None], "preemption": [signal.SIGKILL, [signal.SIGSTOP],
                                                           [True], ["SIGTERM"], [0]],
    "heartbeat_interval": [-5, float("nan"), "10"], "slow_writer_s": [-1, None],
    "incremental": [1], "full_every": [0], "remote": [3], "remote_options": [[("region", "x")]],
    "remote_keep_last": [0], "direct_io": ["auto", 1, None],
}


def test_every_setting_has_refused_values():
    assert sorted(REFUSED) == sorted(SETTINGS)


@pytest.mark.parametrize("name, value", [(n, v) for n, values in REFUSED.items() for v in values],
                         ids=lambda v: v if isinstance(v, str) else repr(v)[:20])
def test_each_refused_value_is_refused_before_the_directory_is_touched(tmp_path, name, value):
    directory = tmp_path / "ckpt"
    with pytest.raises(InvalidArgumentError, match=f"^{name} must be"):
        CheckpointEngine(directory, {"t": torch.zeros(1)}, **{name: value})
    assert not directory.exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "fast"}, "mode must be 'async' or 'sync', not 'fast'"),
    ({"when_busy": "drop"}, "when_busy must be 'wait' or 'skip'"),
    ({"compression": "lz4"}, "compression must be None or 'zstd'"),
    ({"every": 0}, "every must be an int >= 1, not 0"),
    ({"every": 1.5}, "every must be an int >= 1, not 1.5"),
    ({"keep_last": 0}, "keep_last must be an int >= 1"),
    ({"keep_every": 0}, "keep_every must be None or an int >= 1"),
    ({"rank": 1}, "both rank and world_size"),
    ({"rank": 2, "world_size": 2}, r"rank must be in \[0, world_size\)"),
    ({"rank": 0, "world_size": 100_001}, "at most MAX_WORLD_SIZE = 100000 ranks"),
    ({"commit_timeout": 0}, "commit_timeout must be a number of seconds > 0"),
    ({"rank": 0, "world_size": 2, "when_busy": "skip"}, "when_busy='skip' needs one rank"),
    ({"memory_every": 1, "incremental": True}, "memory_every and incremental=True"),
    ({"memory_every": 1, "slots": 1}, "memory_every needs slots >= 2"),
])
def test_invalid_settings_are_refused_with_a_message(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        EngineOptions(**kwargs)


def test_unknown_settings_and_positional_settings_are_type_errors(ckpt_dir):
    with pytest.raises(TypeError, match="keep_lst"):
        EngineOptions(keep_lst=3)
    with pytest.raises(TypeError, match="keep_lst"):
        CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}, keep_lst=3)
    with pytest.raises(TypeError):
        CheckpointEngine(ckpt_dir, {"t": torch.zeros(1)}, "sync")


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineOptions().every = 2


def test_preemption_needs_the_main_thread():
    errors = []

    def build():
        try:
            EngineOptions(preemption=True)
        except InvalidArgumentError as e:
            errors.append(e)
        EngineOptions(preemption=False)  # nothing to install: fine from any thread

    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    assert errors and "main thread" in str(errors[0])


def test_check_state_refuses_what_cannot_be_snapshotted():
    options = EngineOptions(replicated=["model"])
    options.check_state({"model": torch.zeros(1)})
    with pytest.raises(TypeError, match="state must be a dict"):
        options.check_state([torch.zeros(1)])
    with pytest.raises(InvalidArgumentError, match="reserved"):
        EngineOptions().check_state({RNG_KEY: 1})
    with pytest.raises(InvalidArgumentError, match=r"not in state: \['model'\]"):
        options.check_state({"optimizer": torch.zeros(1)})


def test_shared_settings_are_what_every_rank_must_agree_on():
    settings = EngineOptions(every=5, replicated=["b", "a"], mode="sync").shared_settings()
    assert settings == {"every": 5, "memory_every": None, "keep_last": 3, "keep_every": None,
                        "replicated": ["a", "b"],
                        "spread_replicated": False, "rng": True, "mode": "sync",
                        "remote": None, "remote_keep_last": 3}
    assert EngineOptions(lock_timeout=1, slots=4).shared_settings() == EngineOptions().shared_settings()


def test_the_writer_settings_are_the_writer_config_less_what_the_session_decides():
    """What crosses to the writer is built from the options in one place: with the session's
    facts (where, which lock, the log level), exactly the fields of its WriterConfig."""
    settings = EngineOptions(writer_low_io=False, remote_options={"region": "x"}).writer_settings()
    session = {"root", "own_root", "lock", "log_level"}
    assert settings.keys() | session == {f.name for f in dataclasses.fields(WriterConfig)}
    assert not settings.keys() & session
    # no second default to drift from the option's (remote_keep_last's was 1 here, 3 there)
    assert [f.name for f in dataclasses.fields(WriterConfig)
            if f.default is not dataclasses.MISSING] == []
    assert (settings["nice"], settings["low_io_priority"], settings["rank"]) == (10, False, 0)
    assert settings["remote_keep_last"] == 3 and settings["remote_options"] == {"region": "x"}


def test_the_engine_signature_lists_every_option_with_its_default_and_type():
    """The engine's keyword-only parameters are EngineOptions' fields, one for one: what type
    checkers and help() see is what EngineOptions checks."""
    parameters = inspect.signature(CheckpointEngine).parameters
    assert list(parameters)[:2] == ["directory", "state"]
    options = [p for name, p in parameters.items() if name not in ("directory", "state")]
    fields = dataclasses.fields(EngineOptions)
    assert [p.name for p in options] == [f.name for f in fields]
    for parameter, field in zip(options, fields):
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY
        assert (parameter.default, parameter.annotation) == (field.default, field.type)


def test_the_memory_tier_takes_several_ranks_but_not_incremental_snapshots():
    assert EngineOptions(memory_every=1, slots=3, rank=1, world_size=2).resolved.world_size == 2
    with pytest.raises(InvalidArgumentError, match="several ranks needs slots >= 3"):
        EngineOptions(memory_every=1, slots=2, rank=1, world_size=2)
    with pytest.raises(InvalidArgumentError, match="memory_every and incremental"):
        EngineOptions(memory_every=1, incremental=True)
