"""The example trainer refuses what would train silently wrong: bad configs, a
fresh run over an old one, a resume with another config, and a run whose every
step is skipped. Config errors are raised before JAX does any work."""

import argparse
import json
import os
import sys

import jax.numpy as jnp
import pytest
import yaml

import jaxsync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
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
        ({"checkpoint": {"every": 0}}, [], ["`checkpoint.every` must be an integer >= 1, got 0"]),
        ({"train": {"optimizer": "adam"}}, [], ["`train.optimizer` must be 'zero' or 'ddp'"]),
        ({"train": {"max_consecutive_skips": -1}}, [], ["`train.max_consecutive_skips`"]),
        ({"model": {"scan": "no"}}, [], ["`model.scan` must be true (scanned blocks) or false"]),
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


def _saved_run(run, cfg_path, step=4):
    """A checkpoint written as the trainer writes it, of a run with ``cfg_path``."""
    ns = argparse.Namespace(steps=None, run_dir=str(run), checkpoint_every=None)
    saved = train_gpt.load_config(cfg_path, ns)
    with jaxsync.Checkpointer(run / "checkpoints") as ck:
        ck.save(
            step,
            params={"w": jnp.zeros(3)},
            opt_state={},
            meta={"data_position": step, "config": saved},
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
    assert [r["step"] for r in out["history"]] == [2, 4]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4]
    # before: the old step 100 made orbax skip every new save without a word
    assert jaxsync.Checkpointer(run / "checkpoints").all_steps() == [2, 4]


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
