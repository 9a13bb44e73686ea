"""Many independent multi-device programs on XLA:CPU (see jaxsync/_src/core/cpu_order.py).

Before cpu_order, a checkpoint's checksums dispatched one sharded sum per leaf
all at once, and XLA:CPU deadlocked in a collective and aborted the process
after 40 s (it took the suite's worker down once in a full run).
"""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsync._src.checkpoint.checksum import tree_checksums

SPECS = [P(), P("data"), P("model"), P("data", "model"), P("model", "data"),
         P(None, "data"), P(None, "model"), P(("data", "model"))]  # fmt: skip


def test_checksums_of_many_sharded_leaves_finish_and_ignore_the_sharding():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    host = {f"w{i}": rng.standard_normal((8 * (1 + i % 3), 16 + 8 * (i % 4)), np.float32)
            for i in range(60)}  # fmt: skip
    sharded = {k: jax.device_put(v, NamedSharding(mesh, SPECS[i % len(SPECS)]))
               for i, (k, v) in enumerate(host.items())}  # fmt: skip
    want = tree_checksums(jax.device_put(host, jax.devices()[0]))
    assert len(set(want.values())) == len(host)  # distinct data, distinct sums
    for _ in range(8):  # the deadlock came within 2 rounds
        assert tree_checksums(sharded) == want
