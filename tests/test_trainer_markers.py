"""The example trainer's plot marks what its integrity checks found in metrics.jsonl:
replica mismatches, steps run again and stragglers named (clean checks are not)."""

from __future__ import annotations

import json

import pytest
from test_trainer import yaml_with

import jaxsync

plot_metrics = pytest.importorskip("plot_metrics")  # matplotlib: jaxsync[examples]
train_gpt = pytest.importorskip("train_gpt")

RECORDS = [
    {"step": 1, "loss": 5.5, "reruns": []},
    {"step": 4, "loss": 4.0, "replica_check": ["step 4: replica check: 9 replicated leaves, "
                                               "every copy equal"],
     "reruns": ["step 2 (loss jump, loss 9.1): a numerical event ..."],
     "stragglers": ["step 4: no straggler (host ms per process [1.0, 1.1])"]},
    {"step": 8, "loss": 3.5,
     "reruns": ["step 2 (loss jump, loss 9.1): a numerical event ...",  # an older run's
                "step 6 (nonfinite, loss nan): a transient fault ..."],  # cumulative list
     "stragglers": ["step 8: process 1 (3.0x the median) spend(s) the longest ..."]},
    {"step": 10, "loss": 3.4, "replica_check": ["step 10: replica check: 1 of 9 replicated "
                                                "leaves differ between copies (devices [3]):"]},
]  # fmt: skip


def test_findings_are_marked_at_their_steps_and_clean_checks_are_not(tmp_path):
    assert plot_metrics.events(RECORDS) == {
        "replica mismatch": [10], "step run again": [2, 6], "straggler named": [8],
    }  # fmt: skip
    fig = plot_metrics.figure(RECORDS)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert {"replica mismatch (1)", "step run again (2)", "straggler named (1)"} <= set(labels)
    assert [x.get_xdata()[0] for x in fig.axes[0].lines if x.get_color() == "tab:red"] == [2, 6]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert plot_metrics.plot(str(path)) == str(tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    clean = [{k: v for k, v in r.items() if k != "replica_check"} for r in RECORDS[:2]]
    clean[1].pop("reruns")
    assert plot_metrics.events(clean) == {}


def test_a_replica_mismatch_that_stops_the_trainer_is_in_its_metrics(tmp_path, monkeypatch):
    # A replica that diverged at the check after step 4: the run stops, and the record
    # it leaves lets plot_metrics.py mark where.
    real = jaxsync.replica_check

    def diverged(step, state):
        report = real(step, state)
        bad = jaxsync.ReplicaMismatch("params['w']", (3,), 8)
        return jaxsync.ReplicaReport(report.checked, (bad,))

    monkeypatch.setattr(jaxsync, "replica_check", diverged)
    cfg = yaml_with(tmp_path, integrity={"replica_check_every": 4}, checkpoint={"every": 100})
    run = tmp_path / "run"
    with pytest.raises(train_gpt.RunStopped, match="step 4: replica check"):
        train_gpt.main(["--config", cfg, "--run-dir", str(run), "--steps", "8"])
    records = plot_metrics.read_metrics(str(run / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 4] and all("loss" in r for r in records)
    assert plot_metrics.events(records) == {"replica mismatch": [4]}
