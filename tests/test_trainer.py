"""The example trainer refuses what would train silently wrong: bad configs, a
fresh run over an old one, a resume with another config, and a run whose every
step is skipped. Config errors are raised before JAX does any work. Its data
(Python's stdlib sources) splits into disjoint train and validation files, and
its batches do not depend on how many devices or processes share them."""

import argparse
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh

import jaxsync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import text_data  # noqa: E402
import train_gpt  # noqa: E402

CONFIG = os.path.join(ROOT, "tests", "data", "test_gpt.yaml")


def yaml_with(tmp_path, **sections):
    """tests/data/test_gpt.yaml with some keys replaced (a section by a non-mapping too)."""
    with open(CONFIG) as f:
        cfg = yaml.safe_load(f)
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize(
    "sections, argv, words",
    [
        ({"train": 5}, [], ["`train` must be a mapping of keys", "got 5 (int)"]),
        ({"train": {"steps": "ten"}}, [], ["`train.steps` must be an integer >= 1", "'ten' (str)"]),
        ({"train": {"lr": "3e-3"}}, [], ["`train.lr` must be a number > 0", "write 3.0e-3"]),
        (
            {"train": {"warmup": 30}},
            ["--steps", "20"],
            ["`train.warmup`=30", "`train.steps`=20 (--steps)", "Lower the warmup"],
        ),
        ({"train": {"warmup": 12}}, [], ["`train.warmup`=12", "must be < `train.steps`=12"]),
        ({"checkpoint": {"every": 0}}, [], ["`checkpoint.every` must be an integer >= 1, got 0"]),
        ({"train": {"optimizer": "adam"}}, [], ["`train.optimizer` must be 'zero' or 'ddp'"]),
        ({"train": {"max_consecutive_skips": -1}}, [], ["`train.max_consecutive_skips`"]),
        ({"model": {"scan": "no"}}, [], ["`model.scan` must be true (scanned blocks) or false"]),
        ({"data": {"val_fraction": 1.0}}, [], ["`data.val_fraction` must be a number between"]),
        ({"eval": {"every": 0}}, [], ["`eval.every` must be an integer >= 1, got 0"]),
        ({"data": {"max_bytes": 100}}, [], ["train split holds 0 bytes", "`data.max_bytes`"]),
        ({"integrity": {"loss_jump": 1}}, [], ["`integrity.loss_jump` must be a number > 1"]),
        ({"integrity": {"rerun": "yes"}}, [], ["`integrity.rerun` must be true or false"]),
        ({"integrity": {"straggler_every": 1}}, [], ["`integrity.straggler_every` must be"]),
    ],
)
def test_bad_config_fails_before_any_work(tmp_path, sections, argv, words):
    path = yaml_with(tmp_path, **sections)
    with pytest.raises(train_gpt.ConfigError) as e:
        train_gpt.main(["--config", path, "--run-dir", str(tmp_path / "run"), *argv])
    for w in words:
        assert w in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists()


def test_fresh_run_over_an_old_one_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    with pytest.raises(train_gpt.ConfigError, match=r"already holds a run.*--resume.*--overwrite"):
        train_gpt.main(["--config", CONFIG, "--run-dir", str(run)])
    with pytest.raises(SystemExit):  # contradictory flags: argparse's usage error
        train_gpt.main(["--config", CONFIG, "--run-dir", str(run), "--resume", "--overwrite"])
    assert (run / "metrics.jsonl").exists()


def _saved_run(run, cfg_path, step=4, **meta):
    """A checkpoint written as the trainer writes it, of a run with ``cfg_path``."""
    ns = argparse.Namespace(steps=None, run_dir=str(run), checkpoint_every=None)
    saved = train_gpt.load_config(cfg_path, ns)
    with jaxsync.Checkpointer(run / "checkpoints") as ck:
        ck.save(
            step,
            params={"w": jnp.zeros(3)},
            opt_state={},
            meta={"data_position": step, "config": saved, **meta},
        )


def test_resume_with_another_config_is_refused(tmp_path):
    run = tmp_path / "run"
    _saved_run(run, CONFIG)
    changed = yaml_with(tmp_path, train={"lr": 0.02, "seed": 3, "global_batch": 32})
    argv = ["--config", changed, "--run-dir", str(run), "--resume"]
    with pytest.raises(train_gpt.ConfigError) as e:
        train_gpt.main(argv)
    msg = str(e.value)
    assert "saved with another config" in msg and "--allow-config-change" in msg
    assert "train.lr: saved 0.01, now 0.02" in msg
    assert "train.seed: saved 0, now 3" in msg
    assert "train.global_batch: saved 16, now 32" in msg
    # (this fake checkpoint holds no model: getting as far as its arrays is the pass)
    with pytest.raises(jaxsync.CheckpointMismatchError):
        train_gpt.main([*argv, "--allow-config-change"])


def test_resume_on_another_pythons_stdlib_is_refused(tmp_path):
    run = tmp_path / "run"
    _saved_run(run, CONFIG, data={"corpus": "Python 3.99.0 standard library", "train_bytes": 1})
    with pytest.raises(train_gpt.ConfigError, match=r"data: saved \{'corpus': 'Python 3.99.0"):
        train_gpt.main(["--config", CONFIG, "--run-dir", str(run), "--resume"])


def test_where_and_how_often_a_run_writes_may_change_on_resume():
    ns = argparse.Namespace(steps=None, run_dir="a", checkpoint_every=None)
    saved = train_gpt.load_config(CONFIG, ns)
    now = json.loads(json.dumps(saved))
    now["run_dir"], now["log_every"] = "b", 1
    now["checkpoint"] = {"every": 1, "keep": 9, "async": False}
    now["train"].update(bucket_size=1, max_consecutive_skips=1)
    assert train_gpt.config_changes(saved, now) == []
    now["train"]["steps"] = 99  # the cosine schedule runs over all steps
    assert train_gpt.config_changes(saved, now) == ["  train.steps: saved 12, now 99"]


def test_overwrite_starts_over(tmp_path):
    run = tmp_path / "run"
    _saved_run(run, CONFIG, step=100)  # an old run, further along
    (run / "metrics.jsonl").write_text('{"step": 100, "loss": 9.0}\n')
    cfg = yaml_with(tmp_path, checkpoint={"every": 2}, log_every=2)
    out = train_gpt.main(["--config", cfg, "--run-dir", str(run), "--steps", "4", "--overwrite"])
    assert [r["step"] for r in out["history"]] == [1, 2, 4]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 4]
    # before: the old step 100 made orbax skip every new save without a word
    assert jaxsync.Checkpointer(run / "checkpoints").all_steps() == [2, 4]
    # the validation loss, after step 1 and the last step (eval.every is 50), goes down
    val = {r["step"]: r["val_loss"] for r in lines if "val_loss" in r}
    assert sorted(val) == [1, 4] and val[4] < val[1] - 0.1, val
    assert json.loads((run / "run.json").read_text())["data"]["train_bytes"] > 100_000
    mpl_image = pytest.importorskip("matplotlib.image")
    assert out["plot"] == str(run / "loss.png")
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    h, w, _ = mpl_image.imread(out["plot"]).shape
    assert h > 300 and w > 500


def test_stdlib_split_is_disjoint_and_deterministic():
    a = text_data.StdlibText(16, max_bytes=600_000, val_fraction=0.1)
    b = text_data.StdlibText(16, max_bytes=600_000, val_fraction=0.1)
    assert a.files == b.files
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)
    train, val = set(a.files["train"]), set(a.files["val"])
    assert train and val and not train & val  # whole files: no held-out text is trained on
    assert sorted(train | val) == text_data.stdlib_files(max_bytes=600_000)
    assert not any(f.startswith(("test/", "site-packages/")) for f in train | val)
    assert 0.1 <= len(a.val) / (len(a.train) + len(a.val)) < 0.3
    assert len(a.train) + len(a.val) <= 600_000 + len(train | val)  # + separators


def test_batches_are_the_same_on_any_number_of_processes():
    data = text_data.StdlibText(16, seed=3, max_bytes=300_000)
    full = data.batch(7, 16)
    assert full.shape == (16, 17) and full.dtype == np.int32
    for nproc in (2, 4, 8):  # each process draws the global batch and keeps its rows
        rows = 16 // nproc
        parts = [data.batch(7, 16, slice(i * rows, (i + 1) * rows)) for i in range(nproc)]
        np.testing.assert_array_equal(np.concatenate(parts), full)
        vparts = [data.val_batches(3, 16, slice(i * rows, (i + 1) * rows)) for i in range(nproc)]
        np.testing.assert_array_equal(np.concatenate(vparts, axis=1), data.val_batches(3, 16))
    for devices in (8, 4, 1):  # sharded over any mesh, the global batch is the same
        mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
        sharded = jaxsync.shard_batch(full, mesh, axis_name="data")
        np.testing.assert_array_equal(np.asarray(sharded), full)
    assert not np.array_equal(data.batch(8, 16), full)
    other_seed = text_data.StdlibText(16, seed=4, max_bytes=300_000)
    assert not np.array_equal(other_seed.batch(7, 16), full)
    assert bytes(full[0].astype(np.uint8)) in bytes(data.train)  # a window of the text


def test_a_run_that_skips_every_step_stops(tmp_path, monkeypatch):
    real = train_gpt.gpt.loss_fn
    monkeypatch.setattr(train_gpt.gpt, "loss_fn", lambda m, t, *a: real(m, t, *a) * jnp.inf)
    cfg = yaml_with(tmp_path, train={"max_consecutive_skips": 3}, checkpoint={"every": 100})
    with pytest.raises(train_gpt.RunStopped) as e:
        train_gpt.main(["--config", cfg, "--run-dir", str(tmp_path / "run"), "--steps", "10"])
    msg = str(e.value)
    assert "stopping at step 3: the last 3 steps were all skipped" in msg
    assert "train.max_consecutive_skips=3" in msg
    assert "(None)" in msg  # no checkpoint to go back to yet
    assert "the loss inf" in msg or "the loss nan" in msg


def test_the_trainer_checks_its_replicas_and_reruns_a_suspicious_step(tmp_path):
    # Replicas compared every 4 steps (and at the end), a spiking step run again.
    cfg = yaml_with(tmp_path, integrity={"replica_check_every": 4, "rerun": True,
                                         "loss_jump": 1.5, "straggler_every": 4},
                    checkpoint={"every": 100})  # fmt: skip
    run = tmp_path / "run"
    train_gpt.main(["--config", cfg, "--run-dir", str(run), "--steps", "8"])
    with open(run / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    # One record per logged step (1 and every log_every = 4), as readers expect; the
    # checks ride along in the record of the step they ran at.
    assert [r["step"] for r in records] == [1, 4, 8] and all("loss" in r for r in records)
    by_step = {r["step"]: r for r in records}
    assert [len(by_step[s].get("replica_check", [])) for s in (1, 4, 8)] == [0, 1, 1]
    assert all("every copy equal" in c for s in (4, 8) for c in by_step[s]["replica_check"])
    assert all("reruns" in r for r in records)
    assert [len(by_step[s].get("stragglers", [])) for s in (1, 4, 8)] == [0, 1, 1]
    assert all("no straggler" in c for s in (4, 8) for c in by_step[s]["stragglers"])
    # The step's own norms and rate (jaxsync.TrainerMetrics): step 1 ran at the
    # warmup's rate 0, so it moved nothing; the later ones did.
    assert by_step[1]["lr"] == 0.0 and by_step[1]["update_norm"] == 0.0
    assert all(by_step[s]["lr"] > 0 and by_step[s]["update_norm"] > 0 for s in (4, 8))
    assert all(r["param_norm"] > 0 and r["grad_norm"] > 0 for r in records)


def test_a_resume_from_an_older_checkpoint_logs_each_step_once(tmp_path):
    """A run that died after logging step 4 but before its step-4 checkpoint resumes
    from step 2 and runs 3 and 4 again: metrics.jsonl held steps [1, 2, 3, 4, 3, 4],
    and the summary started from the resumed session's first record (found by
    probing the trainer)."""
    run = tmp_path / "run"
    cfg = yaml_with(tmp_path, checkpoint={"every": 2, "async": False}, log_every=1)
    argv = ["--config", cfg, "--run-dir", str(run), "--steps", "4"]
    train_gpt.main(argv)
    first = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    shutil.rmtree(run / "checkpoints" / "4")  # as if the run died before it landed
    out = train_gpt.main([*argv, "--resume"])
    assert [r["step"] for r in out["history"]] == [3, 4]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    # the steps run again are the same steps: the same losses, bit for bit
    assert [r["loss"] for r in lines] == [r["loss"] for r in first]
