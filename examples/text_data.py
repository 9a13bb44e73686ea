"""Real text with no download: the source of Python's own standard library, as bytes.

Every Python installation ships its standard library as ``.py`` files, so the
example trains on real code wherever it runs. The corpus is the stdlib's ``.py``
files in sorted path order (no site-packages, no test suites, no generated or
very large files) up to ``max_bytes``; tokens are bytes (vocabulary 256, so any
UTF-8 round-trips). The split is by whole file: a file is held out for
validation when the CRC-32 of its path falls in the first ``val_fraction`` of
the range, so no validation text is ever trained on, and the split does not move
when ``max_bytes`` changes. The same Python version gives the same corpus;
``describe()`` says which one and how many bytes, for the run's records.

Batch ``step`` is a pure function of (seed, step): the global batch is drawn,
then each process takes its rows, so a run sees the same data on any number of
devices or processes, and a resumed run the data it would have seen.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import zlib

import numpy as np

VOCAB_SIZE = 256  # bytes

# Directories that are not library source: installed packages, test suites,
# bundled wheels, build configuration, codec tables and generated help text.
SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "ensurepip",
        "encodings",
        "pydoc_data",
    }
)
MAX_FILE_BYTES = 200_000  # larger files are generated tables or outliers (_pydecimal)

TOO_SMALL = (
    "the {split} split holds {n:,} bytes, fewer than one sequence of {need} bytes: "
    "raise `data.max_bytes` (now {max_bytes:,}) or `data.val_fraction` (now {val_fraction})."
)


def stdlib_root() -> str:
    """The directory of this interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None, *, max_bytes: int) -> list[str]:
    """Paths (relative to ``root``, '/'-separated) of the corpus's files: the
    stdlib's source files in sorted order, as many as fit in ``max_bytes``."""
    root = root or stdlib_root()
    found = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith("config-")]
        for name in names:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = os.path.join(here, name)
                if os.path.getsize(path) <= MAX_FILE_BYTES:
                    found.append(os.path.relpath(path, root).replace(os.sep, "/"))
    files, total = [], 0
    for f in sorted(found):
        total += os.path.getsize(os.path.join(root, f))
        if total > max_bytes:
            break
        files.append(f)
    return files


def split_files(root: str, files: list[str], val_fraction: float) -> tuple[list, list]:
    """(train, val) files: files in the order of a hash of their path go to
    validation until it holds ``val_fraction`` of the bytes. Whole files, so no
    validation text is trained on; a hash, so the split is the same on every machine."""
    val, held, total = set(), 0, sum(os.path.getsize(os.path.join(root, f)) for f in files)
    for f in sorted(files, key=lambda f: (zlib.crc32(f.encode()), f)):
        if held >= val_fraction * total:
            break
        val.add(f)
        held += os.path.getsize(os.path.join(root, f))
    return [f for f in files if f not in val], [f for f in files if f in val]


class StdlibText:
    """Train and validation bytes of the stdlib corpus, and deterministic batches.

    Args:
      seq_len: tokens per sequence (a batch row holds ``seq_len + 1``: inputs and targets).
      seed: seeds the training batches.
      max_bytes: the corpus's size limit, train and validation together.
      val_fraction: the share of files held out for validation.
      root: the directory to read (default: this interpreter's stdlib).

    Raises:
      ValueError: a split is shorter than one sequence.
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        seq_len: int,
        seed: int = 0,
        *,
        max_bytes: int = 4_000_000,
        val_fraction: float = 0.1,
        root: str | None = None,
    ):
        self.root = root or stdlib_root()
        self.seq_len, self.seed = seq_len, seed
        files = stdlib_files(self.root, max_bytes=max_bytes)
        train, val = split_files(self.root, files, val_fraction)
        self.files = {"train": train, "val": val}
        self.train, self.val = (self._read(self.files[s]) for s in ("train", "val"))
        for split, tokens in (("train", self.train), ("val", self.val)):
            if len(tokens) < seq_len + 1:
                raise ValueError(
                    TOO_SMALL.format(
                        split=split,
                        n=len(tokens),
                        need=seq_len + 1,
                        max_bytes=max_bytes,
                        val_fraction=val_fraction,
                    )
                )

    def _read(self, files: list[str]) -> np.ndarray:
        parts = []
        for f in files:
            with open(os.path.join(self.root, f), "rb") as fh:
                parts.append(fh.read())
        return np.frombuffer(b"\n".join(parts), dtype=np.uint8)

    def batch(self, step: int, global_batch: int, rows: slice | None = None) -> np.ndarray:
        """Rows ``rows`` of training batch ``step``: ``(rows, seq_len + 1)`` int32."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.train) - self.seq_len, size=global_batch)
        return self._windows(self.train, starts[rows] if rows is not None else starts)

    def val_batches(self, n: int, global_batch: int, rows: slice | None = None) -> np.ndarray:
        """``n`` fixed validation batches, windows spread evenly over the validation
        text: ``(n, rows, seq_len + 1)`` int32, the same in every run."""
        starts = np.linspace(0, len(self.val) - self.seq_len - 1, n * global_batch)
        starts = starts.astype(np.int64).reshape(n, global_batch)
        return self._windows(self.val, starts[:, rows] if rows is not None else starts)

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> np.ndarray:
        return tokens[starts[..., None] + np.arange(self.seq_len + 1)].astype(np.int32)

    def describe(self) -> dict:
        """What the run learns from, for its metadata."""
        v = sys.version_info
        return {
            "corpus": f"Python {v.major}.{v.minor}.{v.micro} standard library (.py sources)",
            "root": self.root,
            "vocab": "bytes",
            "train_files": len(self.files["train"]),
            "val_files": len(self.files["val"]),
            "train_bytes": int(len(self.train)),
            "val_bytes": int(len(self.val)),
        }

    @staticmethod
    def decode(tokens: np.ndarray) -> str:
        return bytes(np.asarray(tokens, np.uint8)).decode("utf-8", errors="replace")
