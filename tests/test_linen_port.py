"""A nanodo-style linen trainer, ported from jax.jit + NamedSharding to jaxsync.

examples/linen_port/train_gspmd.py is the trainer as a JAX user writes it: masked
weight decay, clipping, a warmup-cosine schedule, gradient accumulation through
optax.MultiSteps, a padded token-weighted loss with aux metrics, and
nn.with_partitioning annotations. train_jaxsync.py is its port. The port is short,
and it trains equal to single-device training on the global batch in every mode, on
a 1-D and a (data, model) mesh.
"""

import difflib
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import require_devices

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "linen_port"
sys.path.insert(0, str(EXAMPLE))
import model  # noqa: E402
import train_gspmd  # noqa: E402
import train_jaxsync  # noqa: E402

CONFIG = model.Config()


def _code(path: Path) -> list[str]:
    """The file's lines after its module docstring."""
    text = path.read_text()
    return text[text.index('"""', 3) + 3 :].splitlines()


def test_the_port_writes_at_most_15_lines():
    """Lines the port writes (new or changed, not blank); deleting code is free."""
    diff = list(difflib.unified_diff(_code(EXAMPLE / "train_gspmd.py"),
                                     _code(EXAMPLE / "train_jaxsync.py"), lineterm="", n=0))
    written = [d[1:] for d in diff if d.startswith("+") and not d.startswith("+++")]
    written = [line for line in written if line.strip()]
    deleted = [d for d in diff if d.startswith("-") and not d.startswith("---") and d[1:].strip()]
    assert 8 <= len(written) <= 15, "\n".join(written)
    assert len(deleted) <= 25, "\n".join(deleted)


@pytest.fixture(scope="module")
def single_device():
    """The GSPMD trainer on one device with the global batch in one call (no accumulation):
    the token-weighted mean over the whole global batch, which the port must equal."""
    cfg = model.Config(grad_accum=1)
    return train_gspmd.train(cfg, train_gspmd.make_mesh(1, 1), log=lambda _: None)


MESHES = {"1d": lambda: jax.make_mesh((8,), ("data",)), "2d": lambda: train_jaxsync.make_mesh(4, 2)}


@pytest.mark.parametrize("mesh_name", ["1d", "2d"])
@pytest.mark.parametrize("mode", ["zero", "ddp", "fsdp"])
def test_the_port_equals_single_device_training(single_device, mode, mesh_name):
    require_devices(8)
    mesh = MESHES[mesh_name]()
    ref_params, ref_history = single_device
    params, history = train_jaxsync.train(model.Config(mode=mode), mesh, log=lambda _: None)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), params, ref_params
    )
    # The loss of each update: the token-weighted mean over the whole global batch.
    np.testing.assert_allclose([h[0] for h in history], [h[0] for h in ref_history], rtol=1e-5)
    # The aux as one device returns it on the global batch: integers summed over the
    # devices and every microbatch (issue 41: it was the last microbatch's only).
    data = model.batches(CONFIG, CONFIG.batch_size)
    for (_, aux), (_, ref_aux), batch in zip(history, ref_history, data, strict=False):
        assert aux["ntokens"] == ref_aux["ntokens"] == int(np.sum(batch[:, 1:] != model.PAD))
        assert aux["correct"] == ref_aux["correct"]
