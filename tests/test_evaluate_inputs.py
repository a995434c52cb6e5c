"""What `goodput evaluate` says of a checkpoint it cannot evaluate as asked: a step not in the
ledger, a run with nothing validated, a path that is no checkpoint. Each is the user's to fix
(ConfigError: exit status 2, the message alone), said at once: the locate task does not retry
it (3 tries, 10 s of retry delays and a traceback, before)."""

from __future__ import annotations

import asyncio

import pytest
from prefect import flow

from core.errors import ConfigError
from goodput.evaluation import pick_checkpoint
from storage.ledger import Ledger
from storage.store import store_from_config
from tasks.evaluate import locate_checkpoint
from tests.helpers import small_config, task_runs_of


@pytest.fixture
def config(tmp_path):
    """A run whose ledger has one validated checkpoint, step 10 (no weights needed: each
    case fails before a checkpoint is read)."""
    config = small_config(tmp_path, "run.run_id=long")
    Ledger(config.run_dir).record(10, "validated")
    return config


def test_a_step_not_in_the_ledger_is_a_config_error_naming_the_steps(config):
    with pytest.raises(ConfigError, match=r"checkpoint step 999 of run 'long' is not in the "
                                          r"ledger; pick one of \[10\]"):
        pick_checkpoint(config, store_from_config(config.storage), "999")


def test_a_run_with_no_validated_checkpoint_is_a_config_error(tmp_path):
    config = small_config(tmp_path, "run.run_id=doesnotexist")
    with pytest.raises(ConfigError, match="run 'doesnotexist' has no validated checkpoint .*"
                                          "train it first"):
        pick_checkpoint(config, store_from_config(config.storage))


@pytest.mark.parametrize("given", ["abc", "-1", "{tmp}/no/such/checkpoint"])
def test_a_checkpoint_that_does_not_exist_is_said_to_be_missing(config, tmp_path, given):
    given = given.format(tmp=tmp_path)
    with pytest.raises(ConfigError) as error:
        pick_checkpoint(config, store_from_config(config.storage), given)
    message = str(error.value)
    assert f"{given} does not exist" in message, message
    assert "a step number of run 'long'" in message and "checkpoint directory" in message, message
    assert "manifest.json" not in message, message


def test_a_directory_without_a_manifest_is_no_committed_checkpoint(config, tmp_path):
    half_written = tmp_path / "step-00000010"
    half_written.mkdir()
    with pytest.raises(ConfigError, match=r"step-00000010 is not a committed checkpoint "
                                          r"\(no manifest.json\)"):
        pick_checkpoint(config, store_from_config(config.storage), str(half_written))


def test_the_locate_task_tries_an_input_mistake_once(prefect_api, config):
    """A real flow run of the locate task: the ConfigError ends it on the first try."""

    @flow(name="locate-only")
    def locate(checkpoint: str):
        return locate_checkpoint(config, checkpoint)

    state = locate("999", return_state=True)
    assert state.is_failed()
    with pytest.raises(ConfigError, match="is not in the ledger"):
        state.result()
    task_run = task_runs_of(state.state_details.flow_run_id, "locate-checkpoint")["locate-checkpoint"]
    assert task_run.run_count == 1 and task_run.state.is_failed(), task_run


@pytest.mark.parametrize(("error", "retried"), [
    (ConfigError("checkpoint step 999 ... is not in the ledger"), False),
    (ConnectionError("the store is unreachable"), True),
    (TimeoutError("the store did not answer"), True),
])
def test_the_locate_task_retries_only_what_may_pass(error, retried):
    """The task's own retry condition, asked of the state a failed try leaves."""
    from prefect.states import exception_to_failed_state

    state = asyncio.run(exception_to_failed_state(error))
    assert locate_checkpoint.retry_condition_fn(locate_checkpoint, None, state) is retried
