"""``python -m lab perf`` (lab/perf/): the lab's collectives as nccl-tests tables, read back by
``lab.sim.read_nccl_tests``; its checker, its sizes and bandwidths, its argument errors."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import lab
import lab.sim
from lab import perf
from lab.__main__ import main
from lab.perf import Spec


def run_perf(capsys, tmp_path, *argv: str) -> tuple[int, object]:
    """``python -m lab perf ARGV`` in this process: its exit status and its stdout read back."""
    status = main(["perf", *argv])
    log = tmp_path / "perf.log"
    log.write_text(capsys.readouterr().out)
    return status, lab.sim.read_nccl_tests(log)


def test_an_allreduce_table_reads_back_as_an_nccl_tests_log(capsys, tmp_path):
    status, df = run_perf(capsys, tmp_path, "allreduce", "-b", "1K", "-e", "16K", "-f", "2", "--ranks", "2")
    assert status == 0
    assert df["bytes"].tolist() == [1024, 2048, 4096, 8192, 16384]
    assert df["count"].tolist() == [256, 512, 1024, 2048, 4096]
    assert set(df["dtype"]) == {"float"} and set(df["redop"]) == {"sum"} and set(df["root"]) == {-1}
    assert (df["oop_wrong"] == 0).all() and (df["ip_wrong"] == 0).all()
    assert (df["oop_time_us"] > 0).all() and (df["ip_time_us"] > 0).all()
    attrs = df.attrs
    assert (attrs["collective"], attrs["ranks"], attrs["hosts"], attrs["program"]) == ("allreduce", 2, 1,
                                                                                       "all_reduce_perf")
    assert attrs["params"]["min_bytes"] == 1024 and attrs["params"]["step_factor"] == 2
    assert attrs["out_of_bounds"] == 0 and attrs["complete"] and attrs["devices"] == ["lab-shm"]


@pytest.mark.parametrize("collective, argv", [
    ("allgather", ["-d", "int8"]),
    ("reduce_scatter", ["-d", "half", "-o", "max"]),
    ("broadcast", ["-r", "2", "-d", "bfloat16"]),
    ("all_to_all", ["-d", "uint64"]),
    ("reduce", ["-r", "1", "-o", "avg", "-d", "double"]),])
def test_every_collective_is_right_on_every_rank_at_three_ranks(capsys, tmp_path, collective, argv):
    """Three ranks: sizes that N does not divide are rounded down as nccl-tests does."""
    status, df = run_perf(capsys, tmp_path, collective, "-b", "1000", "-e", "4000", "-f", "4", "-n", "2",
                          "-w", "1", "--ranks", "3", *argv)
    itemsize = perf.TYPES[df["dtype"].iloc[0]].itemsize
    splits = collective in ("allgather", "reduce_scatter", "all_to_all")
    counts = [nbytes // itemsize // (3 if splits else 1) for nbytes in (1000, 4000)]
    assert status == 0 and df.attrs["collective"] == collective and df.attrs["ranks"] == 3
    assert df["count"].tolist() == counts
    assert df["bytes"].tolist() == [count * itemsize * (3 if splits else 1) for count in counts]
    assert (df["oop_wrong"] == 0).all() and (df["ip_wrong"] == 0).all()


def test_without_checks_wrong_is_na(capsys, tmp_path):
    status, df = run_perf(capsys, tmp_path, "broadcast", "-b", "64", "-e", "64", "-c", "0", "--ranks", "2")
    assert status == 0 and df["oop_wrong"].isna().all() and df.attrs["params"]["validation"] == 0


def sabotaged(mesh: lab.Mesh, spec: Spec, nbytes: int) -> dict:
    """perf's measurement in one rank, where rank 1's allreduce gets three elements wrong."""
    right = perf.collectives.allreduce

    def wrong(mesh: lab.Mesh, tensor: torch.Tensor, **options) -> torch.Tensor:
        right(mesh, tensor, **options)
        tensor[:3] += 1
        return tensor

    if mesh.rank == 1:
        perf.collectives.allreduce = wrong  # this rank process only; its pool ends with the test
    return perf.bench_size(mesh, spec, nbytes)


def test_a_wrong_result_is_counted_on_the_rank_that_has_it_and_fails_the_run():
    per_rank = lab.spawn(sabotaged, 2, args=(Spec("allreduce", iters=2, warmup=1), 1024))
    assert [rank["oop"][1] for rank in per_rank] == [0, 3] and [rank["ip"][1] for rank in per_rank] == [0, 3]
    text, _, failed = perf.row(Spec("allreduce"), 1024, per_rank)
    assert text.split()[8] == text.split()[12] == "3" and failed == 2
    assert "Out of bounds values : 2 FAILED" in perf.footer([1.0], failed)


def test_the_checker_counts_every_element_that_differs_bit_for_bit():
    want = perf.expected(Spec("allgather", "float", None), 4, rank=0, world_size=2)
    assert want.tolist() == [0, 2, 4, 6, 1, 3, 5, 7] and perf.count_wrong(want.clone(), want) == 0
    got = want.clone()
    got[[1, 6]] = -got[[1, 6]]
    assert perf.count_wrong(got, want) == 2
    assert perf.count_wrong(torch.tensor([0.0]), torch.tensor([-0.0])) == 1  # bits, not ==
    assert perf.count_wrong(want[:5], want) == 8  # a wrong shape: all wrong


@pytest.mark.parametrize("op", perf.OPS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_the_closed_form_reduction_is_the_ranks_inputs_reduced_and_exact(op, world_size):
    index = np.arange(3000, dtype=np.int64)
    for dtype in ("bfloat16", "half", "float", "int32"):
        if op == "avg" and dtype == "int32":
            continue
        limit = perf.exact_limit(dtype)
        inputs = [perf.pattern(index, rank, world_size, op, limit) for rank in range(world_size)]
        combine = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
                   "max": np.maximum}[op]
        want = functools.reduce(combine, inputs) // (world_size if op == "avg" else 1)
        assert (perf.reduced(index, world_size, op, limit) == want).all()
        sums = [functools.reduce(np.add, inputs)] if op in ("sum", "avg") else []  # (avg's, before dividing)
        for values in [*inputs, want, *sums]:
            assert (perf.as_tensor(values, dtype).to(torch.float64).numpy() == values).all(), (dtype, op)


@pytest.mark.parametrize("collective, factor", [("allreduce", 2 * 3 / 4), ("allgather", 3 / 4),
                                                ("reduce_scatter", 3 / 4), ("broadcast", 1.0),
                                                ("reduce", 1.0), ("all_to_all", 3 / 4)])
def test_busbw_is_algbw_times_nccl_tests_factor(collective, factor):
    per_rank = [{"oop": (100.0, 0), "ip": (50.0, 0)}] * 4
    spec = Spec(collective, op="sum" if collective in ("allreduce", "reduce_scatter", "reduce") else None)
    text, busbw, _ = perf.row(spec, 1 << 20, per_rank)
    fields = text.split()
    assert float(fields[5]) == 100.0 and float(fields[6]) == round((1 << 20) / 100e3, 2)
    assert busbw == pytest.approx([(1 << 20) / 100e3 * factor, (1 << 20) / 50e3 * factor])
    root = "0" if collective in ("broadcast", "reduce") else "-1"
    assert float(fields[7]) == round(busbw[0], 2) and fields[4] == root


def test_ranks_times_combine_as_average_says_and_times_print_as_nccl_tests():
    per_rank = [{"oop": (10.0, 0), "ip": (10.0, 0)}, {"oop": (20.0, 0), "ip": (20.0, 0)}]
    times = {a: float(perf.row(Spec("allreduce"), 1024, per_rank, a)[0].split()[5]) for a in perf.AVERAGES}
    assert times == {0: 10.0, 1: 15.0, 2: 10.0, 3: 20.0}
    assert [perf.format_time(us) for us in (3.14159, 123.456, 12345.6)] == ["   3.14", "  123.5", "  12346"]


def test_sizes_and_layout_are_nccl_tests():
    assert perf.sizes(1024, 4096, 1, 1024) == [1024, 2048, 3072, 4096]
    assert perf.sizes(1000, 1000, 2) == [1000]
    assert perf.layout("reduce_scatter", 1024, 3, 2) == (1020, 170)
    assert perf.layout("broadcast", 1023, 3, 4) == (1020, 255)
    assert [perf.parse_size(text) for text in ("1", "2k", "1G", "0.5M")] == [1, 2048, 1 << 30, 1 << 19]


@pytest.mark.parametrize("argv, names", [
    (["allreduce", "-b", "0"], "-b/--minbytes"),
    (["allreduce", "-b", "1X"], "-b/--minbytes"),
    (["allreduce", "-b", "4K", "-e", "1K"], "-e/--maxbytes"),
    (["allgathr"], "collective"),
    (["allreduce", "-d", "int8"], "-d/--datatype"),
    (["allreduce", "-d", "int32", "-o", "avg"], "-o/--op"),
    (["broadcast", "-r", "4", "--ranks", "4"], "-r/--root"),
    (["allreduce", "--algorithm", "bruck"], "--algorithm"),
    (["allreduce", "--ranks", "3", "--hosts", "2"], "--hosts"),
    (["allreduce", "--hosts", "2", "--transport", "shm"], "--transport"),
    (["allreduce", "--link-gbit", "1"], "--link-gbit"),
    (["allreduce", "-n", "0"], "-n/--iters"),])
def test_bad_arguments_are_argparse_errors_naming_the_option_before_anything_runs(
        capsys, monkeypatch, argv, names):
    def launch(*args, **kwargs):
        raise AssertionError("a pool started")

    monkeypatch.setattr(perf, "launch", launch)
    with pytest.raises(SystemExit) as exited:
        main(["perf", *argv])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument {names}" in error and "python -m lab perf" in error


def test_nccl_tests_names_name_the_collectives():
    given = ("alltoall", "all_reduce_perf", "reduce_scatter", "ALL_GATHER")
    want = ["all_to_all", "allreduce", "reduce_scatter", "allgather"]
    assert [perf._collective(name) for name in given] == want
