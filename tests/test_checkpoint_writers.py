"""Checkpoints (#44): an incomplete newest step names itself and the step to restore, and
a save never overwrites a step that another writer saved into the same directory."""

import json
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsync
from jaxsync._src.checkpoint.lock import LOCK_NAME

TX = optax.sgd(0.1)
# A writer named in a refusal: here a second Checkpointer of the test's own process.
WRITER = r"process \d+ on host .*, another jaxsync.Checkpointer of this very process"


def params(v):
    return {"w": jnp.full((4,), float(v))}


def save(ck, step, value=None):
    p = params(step if value is None else value)
    ck.save(step, params=p, opt_state=TX.init(p))


def restored(directory, step):
    p = params(0)
    with jaxsync.Checkpointer(directory) as ck:
        out = ck.restore(params_like=p, opt_state_like=TX.init(p), step=step)
    return float(np.asarray(out.params["w"])[0])


# ------------------------------------------------------------ an incomplete step
def test_an_incomplete_newest_step_names_the_complete_one(tmp_path):
    with jaxsync.Checkpointer(tmp_path) as ck:
        save(ck, 1)
        save(ck, 2)
    os.remove(tmp_path / "2" / "state" / "_METADATA")
    p = params(0)
    with jaxsync.Checkpointer(tmp_path) as ck:
        # It was "no complete checkpoint ... start without --resume", with step 1 complete.
        with pytest.raises(jaxsync.CorruptCheckpointError) as e:
            ck.restore(params_like=p, opt_state_like=TX.init(p))
        msg = str(e.value)
        assert "checkpoint step 2 in" in msg and "2/state/_METADATA is missing" in msg
        assert "The newest complete step is 1: restore it with `step=1`" in msg
        assert "--" not in msg  # no example-trainer flag in the library's text
        assert float(ck.restore(params_like=p, opt_state_like=TX.init(p), step=1).params["w"][0])
    with jaxsync.Checkpointer(tmp_path / "one") as ck:
        save(ck, 1)
    os.remove(tmp_path / "one" / "1" / "state" / "_METADATA")
    with (
        jaxsync.Checkpointer(tmp_path / "one") as ck,
        pytest.raises(
            jaxsync.CorruptCheckpointError,
            match=r"step 1 .* is incomplete.*No other "
            r"step in .* is complete: start the run afresh",
        ),  # fmt: skip
    ):
        ck.restore(params_like=p, opt_state_like=TX.init(p))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint") as e:
        jaxsync.Checkpointer(tmp_path / "empty").restore(params_like=p, opt_state_like=TX.init(p))
    assert "--resume" not in str(e.value)


# --------------------------------------------------------------- two writers
def test_a_writer_never_overwrites_a_step_another_writer_saved(tmp_path):
    a = jaxsync.Checkpointer(tmp_path)
    b = jaxsync.Checkpointer(tmp_path)
    save(b, 5)
    save(b, 6)  # returned OK: it stays B's
    b.close()  # B's marker is gone; A's cached steps never saw B's
    for step in (6, 4):  # 6 was overwritten with force=True
        refused = rf"cannot save step {step} in .*: another writer \({WRITER}, .*\) saved step"
        with pytest.raises(ValueError, match=refused + r"\(s\) \[5, 6\] there"):
            save(a, step, value=-1)
    assert restored(tmp_path, 6) == 6.0 and restored(tmp_path, 5) == 5.0
    save(a, 7)  # newer than every step there: the directory was free again
    a.close()
    assert jaxsync.Checkpointer(tmp_path).all_steps() == [5, 6, 7]
    assert [restored(tmp_path, s) for s in (5, 6, 7)] == [5.0, 6.0, 7.0]


def test_a_writer_whose_marker_was_deleted_reads_the_directory_again(tmp_path):
    a = jaxsync.Checkpointer(tmp_path)
    save(a, 1)
    a.wait()
    os.remove(tmp_path / LOCK_NAME)  # as HELD's message allows for a dead run
    with jaxsync.Checkpointer(tmp_path) as b:
        save(b, 2)
    with pytest.raises(ValueError, match=r"cannot save step 2 .* saved step\(s\) \[2\]"):
        save(a, 2, value=-1)
    a.close()
    assert restored(tmp_path, 2) == 2.0


def test_a_writer_taken_over_is_refused(tmp_path):
    a = jaxsync.Checkpointer(tmp_path)
    save(a, 1)
    a.wait()
    with jaxsync.Checkpointer(tmp_path, take_over=True) as b:
        save(b, 2)
        b.wait()
        # A still thought it held the directory, and wrote on.
        with pytest.raises(ValueError, match=f"was taken over by another writer: {WRITER}"):
            save(a, 3, value=-1)
        with open(tmp_path / LOCK_NAME) as f:
            assert json.load(f)["token"] == b._lock.token
    a.close()
    assert jaxsync.Checkpointer(tmp_path).all_steps() == [1, 2]
    assert restored(tmp_path, 2) == 2.0
