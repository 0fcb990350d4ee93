"""EngineOptions: every engine setting's default, resolution and validation, in one place."""

import dataclasses
import signal
import threading

import pytest
import torch

from async_ckpt import CheckpointEngine
from async_ckpt.format.names import RNG_KEY
from async_ckpt.options import DEFAULT_PREEMPTION_SIGNALS, EngineOptions


def test_defaults_are_resolved_at_construction():
    options = EngineOptions()
    assert (options.rank, options.world_size) == (0, 1)
    assert options.writer_nice == 10  # async mode leaves the CPU to training
    assert EngineOptions(mode="sync").writer_nice == 0
    assert EngineOptions(writer_nice=3).writer_nice == 3
    assert options.replicated == frozenset() and options.preemption == ()


def test_replicated_and_preemption_are_normalised():
    assert EngineOptions(replicated="model").replicated == frozenset({"model"})
    assert EngineOptions(replicated=["a", "b", "a"]).replicated == frozenset({"a", "b"})
    assert EngineOptions(preemption=True).preemption == DEFAULT_PREEMPTION_SIGNALS
    assert EngineOptions(preemption=[signal.SIGUSR2]).preemption == (signal.SIGUSR2,)
    assert EngineOptions(preemption=None).preemption == ()


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "fast"}, "mode must be 'async' or 'sync', not 'fast'"),
    ({"when_busy": "drop"}, "when_busy must be 'wait' or 'skip'"),
    ({"compression": "lz4"}, "compression must be None or 'zstd'"),
    ({"every": 0}, "every must be an int >= 1"),
    ({"every": 1.5}, "every must be an int >= 1"),
    ({"keep_last": 0}, "keep_last must be an int >= 1"),
    ({"keep_every": 0}, "keep_every must be None or an int >= 1"),
    ({"rank": 1}, "both rank and world_size"),
    ({"rank": 2, "world_size": 2}, r"rank must be in \[0, world_size\)"),
    ({"commit_timeout": 0}, "commit_timeout must be positive"),
    ({"rank": 0, "world_size": 2, "when_busy": "skip"}, "when_busy='skip' needs one rank"),
])
def test_invalid_settings_are_refused_with_a_message(kwargs, message):
    with pytest.raises(ValueError, match=message):
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
        except ValueError as e:
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
    with pytest.raises(ValueError, match="reserved"):
        EngineOptions().check_state({RNG_KEY: 1})
    with pytest.raises(ValueError, match=r"not in state: \['model'\]"):
        options.check_state({"optimizer": torch.zeros(1)})


def test_shared_settings_are_what_every_rank_must_agree_on():
    settings = EngineOptions(every=5, replicated=["b", "a"], mode="sync").shared_settings()
    assert settings == {"every": 5, "keep_last": 3, "keep_every": None, "replicated": ["a", "b"],
                        "spread_replicated": False, "rng": True, "mode": "sync",
                        "remote": None, "remote_keep_last": 3}
    assert EngineOptions(lock_timeout=1, slots=4).shared_settings() == EngineOptions().shared_settings()


def test_the_engine_signature_lists_every_option_with_its_default():
    import dataclasses
    import inspect

    from async_ckpt import CheckpointEngine
    from async_ckpt.options import EngineOptions

    parameters = inspect.signature(CheckpointEngine).parameters
    assert list(parameters)[:2] == ["directory", "state"]
    for field in dataclasses.fields(EngineOptions):
        assert parameters[field.name].kind is inspect.Parameter.KEYWORD_ONLY
        assert parameters[field.name].default == field.default
