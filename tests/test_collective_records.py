"""lab.catalog, one record per collective (issue 41, item 2): its facts against nccl-tests' and the
lab's own calls, the parts that read it (perf, the log reader, the simulator, workloads), and the
one nccl-tests text writer read back by the reader beside it.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import lab
from lab import catalog
from lab.algorithms import registry
from lab.perf import table
from lab.sim import cluster, cluster_cases, log_ranks, read_nccl_tests
from lab.workload import format as workload_format

pytestmark = pytest.mark.no_ranks

ROOT = Path(__file__).resolve().parent.parent
RECORDS = catalog.COLLECTIVES
#: nccl-tests' busbw / algbw at 8 ranks (its doc/PERFORMANCE.md).
AT_8 = {
    "allreduce": 1.75, "broadcast": 1.0, "allgather": 0.875, "reduce_scatter": 0.875, "reduce": 1.0,
    "all_to_all": 0.875, "barrier": 0.0, "gather": 0.875, "scatter": 0.875}


def test_the_catalog_imports_nothing_of_the_lab():
    """Every floor may read it: it may import nothing that imports it back."""
    tree = ast.parse((ROOT / "lab" / "catalog.py").read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    assert not [name for name in imported if name.split(".")[0] in ("lab", "kernels")], imported


def test_every_collective_the_lab_runs_has_one_record_in_the_registrys_order():
    assert tuple(RECORDS) == registry.COLLECTIVES == workload_format.COLLECTIVES
    assert all(name == record.name for name, record in RECORDS.items())


@pytest.mark.parametrize("name", RECORDS)
def test_a_record_says_what_the_public_call_takes(name):
    """rooted: the call's root keyword (src, dst); reduces: it takes an op."""
    parameters = inspect.signature(getattr(lab, name)).parameters
    record = RECORDS[name]
    assert (record.root in parameters) if record.rooted else not {"src", "dst"} & set(parameters)
    assert ("op" in parameters) == record.reduces


@pytest.mark.parametrize("name", RECORDS)
def test_bus_factors_and_input_bytes_are_nccl_tests(name):
    record = RECORDS[name]
    assert record.bus_factor(8) == pytest.approx(AT_8[name])
    # nccl-tests' size is the output of allgather and gather (each rank's input is size / N),
    # the input of the others; whole float32 elements, rounded down
    assert record.input_bytes(1 << 20, 16) == (1 << 16 if name in ("allgather", "gather") else 1 << 20)
    assert record.input_bytes(1027, 2) == (512 if record.sized_by_output else 1024)
    assert record.moves_bytes == (name != "barrier") and bool(record.program) == record.moves_bytes


def test_the_readers_perf_and_the_simulator_read_the_records():
    """Each part's own names, kept, are the records' facts (no copy of its own)."""
    assert log_ranks.COLLECTIVES == catalog.MEASURED and "barrier" not in log_ranks.COLLECTIVES
    assert log_ranks.BUS_FACTOR == {
        "allreduce": 2.0, "allgather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0, "gather": 1.0,
        "scatter": 1.0}
    assert log_ranks.FLAT == ("broadcast", "reduce") and cluster.BUS_FACTOR == log_ranks.BUS_FACTOR
    assert cluster_cases.OUTPUT_SIZED == ("allgather", "gather")
    assert lab.perf.PROGRAMS["all_to_all"] == "alltoall_perf"
    assert lab.sim.schedule.ROOTED == {"broadcast": "src", "reduce": "dst", "gather": "dst", "scatter": "src"}


def test_a_gathers_predicted_busbw_is_nccl_tests():
    """gather's and scatter's busbw is algbw · (N-1)/N (the simulator's copy of the factors had
    none for them: busbw = algbw)."""
    net = lab.sim.Network(alpha_us=5.0, gbit=100.0)
    predicted = cluster.predict_table(net, "gather", 4, [1 << 20])
    assert predicted["busbw"][0] == pytest.approx(predicted["algbw"][0] * 3 / 4)


@pytest.mark.parametrize("collective, hosts", [("allreduce", 4), ("allgather", 3), ("all_to_all", 2),
                                               ("broadcast", 2), ("reduce_scatter", 1)])
def test_a_predicted_table_reads_back_as_nccl_tests_text(tmp_path, collective, hosts):
    """python -m lab cluster fit's tables are nccl-tests' text (the writer perf prints with):
    read_nccl_tests gives back the collective, the sizes, the times as printed, the algorithm."""
    net = lab.sim.Network(alpha_us=5.0, gbit=100.0)
    sizes = [1 << 12, 3 << 20, 64 << 20]
    predicted = cluster.predict_table(net, collective, hosts, sizes)
    path = tmp_path / "prediction.txt"
    path.write_text(table.predicted(collective, hosts, predicted.itertuples(index=False)) + "\n")
    df = read_nccl_tests(path)
    assert (df.attrs["collective"], df.attrs["collective_from"]) == (collective, "program")
    world = hosts if RECORDS[collective].splits else 1
    assert list(df["bytes"]) == [size // 4 // world * 4 * world for size in sizes]
    assert list(df["algorithm"]) == list(predicted["algorithm"])
    assert df["oop_time_us"].tolist() == pytest.approx(predicted["time_us"].tolist(), rel=1e-3)
    assert df["ip_time_us"].isna().all() and df["oop_wrong"].isna().all()
    if hosts > 1:
        assert df.attrs["ranks"] in (hosts, None)
