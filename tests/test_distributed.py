import pytest

import jaxsync
from jaxsync.launch import free_port


def test_single_process_is_a_no_op(monkeypatch):
    for var in (
        "JAXSYNC_COORDINATOR",
        "SLURM_NTASKS",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "JOBSET_NAME",
    ):
        monkeypatch.delenv(var, raising=False)
    info = jaxsync.initialize()
    assert info.how == "single process"
    assert info.num_processes == 1 and info.process_id == 0
    assert info.global_devices == info.local_devices == 8


def test_partial_explicit_arguments_rejected():
    with pytest.raises(ValueError, match="`coordinator_address`, `num_processes` and"):
        jaxsync.initialize("127.0.0.1:1234")


def test_single_task_cluster_variable_is_not_multi_process(monkeypatch):
    monkeypatch.delenv("JAXSYNC_COORDINATOR", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert jaxsync.initialize().how == "single process"


def test_free_port_is_usable():
    assert 0 < free_port() < 65536
