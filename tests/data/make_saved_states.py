"""Writes `tests/data/saved_states/`: checkpoints that later versions must restore.

Run once per on-disk format change, never to refresh a failing test: the point of
the files is that they were written by an older jaxsync (the first set, before the
package reorganisation of jaxsync/_src, at commit 0c144d6). `test_saved_states.py`
restores them with today's code and compares against the same run made now.

    python tests/data/make_saved_states.py
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
import saved_state_run  # noqa: E402

import jaxsync  # noqa: E402

OUT = pathlib.Path(__file__).parent / "saved_states"

if __name__ == "__main__":
    shutil.rmtree(OUT, ignore_errors=True)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    for case in saved_state_run.CASES:
        step, state = saved_state_run.run(case, mesh)
        with jaxsync.Checkpointer(OUT / case, max_to_keep=1) as ckpt:
            ckpt.save_state(step, state, meta={"case": case})
    print(sorted(p.name for p in OUT.iterdir()))
