"""Draws docs/img/layout.svg from a real jaxsync layout (run from the repository root):

    .venv/bin/python docs/img/layout.py

A small model with bf16 matrices and fp32 norms, laid out for 4 ranks with
``bucket_size=1024``: one flat buffer per dtype, in reverse tree order, cut into
buckets; each bucket padded so that it splits into 4 equal shards, one per rank.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

import jaxsync  # noqa: E402

RANKS = 4
PARAMS = {
    "embed": jax.ShapeDtypeStruct((37, 16), jnp.bfloat16),
    "layer0": {
        "w": jax.ShapeDtypeStruct((16, 48), jnp.bfloat16),
        "norm": jax.ShapeDtypeStruct((300,), jnp.float32),
    },
    "layer1": {
        "w": jax.ShapeDtypeStruct((48, 16), jnp.bfloat16),
        "norm": jax.ShapeDtypeStruct((300,), jnp.float32),
    },
    "head": jax.ShapeDtypeStruct((16, 37), jnp.bfloat16),
}
COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948"]
RANK_COLORS = ["#d4e3f5", "#fde0c5", "#d5ecd2", "#ecdcec"]


def draw(out: Path, fmt: str = "svg") -> None:
    layout = jaxsync.build_layout(PARAMS, num_shards=RANKS, bucket_size=1024)
    width = 1000.0  # every buffer is drawn this wide, whatever its size
    fig, ax = plt.subplots(figsize=(11, 1.9 + 1.9 * len(layout.buffers)))
    y = 0.0
    for bi, buf in enumerate(layout.buffers):
        top = y
        u = width / buf.size  # drawing units per element
        ax.text(
            0,
            top + 0.55,
            f"buffer {bi}: {buf.key.dtype}, {buf.used} elements used, "
            f"{buf.size - buf.used} padding, {len(buf.buckets)} bucket(s)",
            fontsize=10,
            weight="bold",
            va="bottom",
        )
        # params in the buffer (reverse tree order), padding hatched
        ax.add_patch(
            Rectangle(
                (0, top - 0.5),
                width,
                0.9,
                fill=True,
                facecolor="white",
                edgecolor="0.5",
                hatch="///",
                linewidth=0.5,
            )
        )
        for k, si in enumerate(buf.slots):
            s = layout.slots[si]
            n = 1
            for d in s.shape:
                n *= d
            ax.add_patch(
                Rectangle(
                    (s.start * u, top - 0.5),
                    n * u,
                    0.9,
                    facecolor=COLORS[k % 6],
                    edgecolor="black",
                    linewidth=0.6,
                )
            )
            name = s.path.replace("']['", ".").strip("[]'")
            ax.text(
                (s.start + n / 2) * u,
                top - 0.05,
                f"{name}\n{n} at {s.start}",
                ha="center",
                va="center",
                fontsize=8,
                color="white",
                weight="bold",
            )
        # buckets and each rank's shard of each bucket
        for k, b in enumerate(buf.buckets):
            ax.add_patch(
                Rectangle(
                    (b.start * u, top - 1.0),
                    (b.end - b.start) * u,
                    0.35,
                    fill=False,
                    edgecolor="black",
                    linewidth=1.2,
                )
            )
            ax.text(
                (b.start + b.end) / 2 * u,
                top - 0.83,
                f"bucket {k}: [{b.start}, {b.end})",
                ha="center",
                va="center",
                fontsize=8,
            )
            shard = (b.end - b.start) // RANKS
            for r in range(RANKS):
                x0 = b.start + r * shard
                ax.add_patch(
                    Rectangle(
                        (x0 * u, top - 1.5),
                        shard * u,
                        0.4,
                        facecolor=RANK_COLORS[r],
                        edgecolor="0.3",
                        linewidth=0.6,
                    )
                )
                ax.text(
                    (x0 + shard / 2) * u,
                    top - 1.3,
                    f"rank {r}: [{x0}, {x0 + shard})",
                    ha="center",
                    va="center",
                    fontsize=7,
                )
        y -= 2.6
    ax.text(
        0,
        y + 0.9,
        f"{RANKS} ranks: rank r owns the r-th quarter of every bucket: the "
        "reduce-scatter's output, its fp32 master and optimizer state.\nHatched: padding "
        "(param starts aligned to 64 elements, buckets to a multiple of lcm(4, 128) = 128). "
        "Each buffer is drawn to the same width.",
        fontsize=8.5,
        style="italic",
        va="top",
    )
    ax.set_xlim(-10, width + 10)
    ax.set_ylim(y + 0.4, 1.0)
    ax.axis("off")
    fig.tight_layout()
    plt.rcParams["svg.hashsalt"] = "jaxsync"
    fig.savefig(out, format=fmt, metadata={"Date": None} if fmt == "svg" else None)
    print(layout.summary())


if __name__ == "__main__":
    plt.rcParams["svg.fonttype"] = "none"
    draw(Path(__file__).with_name("layout.svg"))
