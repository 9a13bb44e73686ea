"""Plot training and validation loss against step from a trainer's metrics.jsonl.

    python examples/plot_metrics.py runs/tiny/metrics.jsonl            # -> runs/tiny/loss.png
    python examples/plot_metrics.py runs/tiny/metrics.jsonl -o out.png

train_gpt.py calls ``plot`` at the end of a run; this script re-makes the plot
from any metrics file (of a finished run, or of one still going, or of one a
replica mismatch stopped). The title says what was trained, from the run.json
next to the metrics when there is one. The integrity checks' findings in the
records (``integrity.*`` in the config) are marked as vertical lines at their
steps: replica mismatches, steps run again (jaxsync.Rerun) and processes named
as stragglers; clean checks are not marked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re

from matplotlib import ticker
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure  # no pyplot: Agg only, no GUI, no global state

UNIFORM = math.log(256)  # the loss of a uniform guess over bytes


#: metrics.jsonl key -> (legend label, colour, line style, whether an entry is a finding)
MARKERS = {
    "replica_check": ("replica mismatch", "black", "-", lambda s: "every copy equal" not in s),
    "reruns": ("step run again", "tab:red", "--", lambda s: True),
    "stragglers": ("straggler named", "tab:purple", ":", lambda s: "no straggler" not in s),
}


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _title(run_json: str) -> str:
    if not os.path.exists(run_json):
        return "training and validation loss"
    with open(run_json) as f:
        run = json.load(f)
    data, m = run.get("data", {}), run.get("config", {}).get("model", {})
    what = f"{run.get('params', 0) / 1e6:.2f}M-param byte-level GPT"
    if m:
        what += f" ({m.get('n_layers')} layers, d={m.get('d_model')}, seq {m.get('seq_len')})"
    if not data:
        return what
    return (
        f"{what}\non {data['corpus']}: {data['train_bytes'] / 1e6:.1f} MB train, "
        f"{data['val_bytes'] / 1e6:.2f} MB held-out files"
    )


def events(records: list[dict]) -> dict[str, list[int]]:
    """The steps of the integrity findings in ``records``, per legend label.

    Each entry is a report's text, which starts with its step ("step 12: ..."; a
    rerun's is the state's step count); an entry seen in an earlier record (older
    runs logged every rerun so far in each record) is counted once.
    """
    found: dict[str, list[int]] = {}
    for key, (label, _, _, is_finding) in MARKERS.items():
        seen: set[str] = set()
        for r in records:
            for text in r.get(key, []):
                if text in seen or not is_finding(text):
                    continue
                seen.add(text)
                m = re.match(r"step (\d+)", text)
                found.setdefault(label, []).append(int(m.group(1)) if m else r["step"])
    return found


def plot(metrics_path: str, out: str | None = None) -> str:
    """Writes the loss curves of ``metrics_path`` to ``out`` (default: loss.png
    beside it) and returns its path."""
    records = read_metrics(metrics_path)
    out = out or os.path.join(os.path.dirname(metrics_path) or ".", "loss.png")
    fig = figure(records, _title(os.path.join(os.path.dirname(metrics_path), "run.json")))
    fig.savefig(out)
    return out


def figure(records: list[dict], title: str = "training and validation loss") -> Figure:
    """The plot of ``records`` (loss curves and integrity findings), not yet saved."""
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]

    fig = Figure(figsize=(7, 4.5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        s, v = zip(*train, strict=True)
        ax.plot(s, v, color="tab:blue", lw=1.2, alpha=0.8, label=f"train (last {v[-1]:.3f})")
    if val:
        s, v = zip(*val, strict=True)
        label = f"validation (last {v[-1]:.3f})"
        ax.plot(s, v, "o-", color="tab:orange", lw=1.8, ms=4, label=label)
    label = f"uniform over bytes (ln 256 = {UNIFORM:.2f})"
    ax.axhline(UNIFORM, color="gray", ls=":", lw=1, label=label)
    found = events(records)
    for name, color, style, _ in MARKERS.values():
        steps = found.get(name, [])
        for i, step in enumerate(steps):
            label = None if i else f"{name} ({len(steps)})"
            ax.axvline(step, color=color, ls=style, lw=1.2, label=label)
    ax.set_yscale("log")  # early losses fall fast; the later gains still show
    ax.yaxis.set_major_locator(ticker.FixedLocator([0.5, 0.75, 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6]))
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats per byte, log scale)")
    ax.set_xlim(left=0)
    ax.set_ylim(top=UNIFORM * 1.2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="center right")
    ax.set_title(title, fontsize=10)
    return fig


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", nargs="?", default="runs/tiny/metrics.jsonl")
    ap.add_argument("-o", "--out", default=None, help="PNG to write (default: loss.png beside)")
    args = ap.parse_args()
    print(plot(args.metrics, args.out))
