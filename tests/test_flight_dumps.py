"""torch-format flight-recorder dumps: read (lab/backend/flight_verdict.py), written by the lab (lab/backend/flight_dumps.py).

The fixtures under tests/data/flight/BACKEND/CASE/rank_R come from
``python tests/scripts/flight_job.py --all tests/data/flight`` (4-rank jobs whose rank 1 skips
its third all_reduce, passes float32[9] there, or hangs before it; gloo's dumps are torch 2.13's
own). torch's reader ``fr_trace`` is the reference where it works: on gloo's dumps with the
default group's empty name in ``pg_config`` put right (it raises ``KeyError: ('0', 3)`` on them as
they are); it refuses the lab's, whose verdict must then be gloo's for the same job.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import wait_until
from scripts import flight_job

import lab
import lab.backend
from lab.backend import flight_dumps
from lab.backend.flight_verdict import divergences, read_dump, read_dumps, report

HERE = os.path.dirname(__file__)
FIXTURES = os.path.join(HERE, "data", "flight")
CASES = ("skip", "size", "hang")
#: (collective number, kind, odd ranks) of each job: what fr_trace says of gloo's dumps.
EXPECTED = {"skip": (4, "missing", [1]), "size": (3, "size", [1]), "hang": (3, "missing", [1])}


def verdict(directory: str) -> tuple[int, str, list[int]]:
    first = divergences(read_dumps(directory))[0]
    return first.seq, first.kind, first.culprits


def fr_trace_verdict(directory: str, scratch: str) -> tuple[int, str, list[int]]:
    """torch's fr_trace's first failing collective of the dumps in ``directory``, read from a
    copy whose default group is named in ``pg_config`` as its entries name it."""
    from torch.distributed.flight_recorder.components.builder import build_db
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from torch.distributed.flight_recorder.components.loader import read_dir
    from torch.distributed.flight_recorder.components.types import MatchState

    os.makedirs(scratch, exist_ok=True)
    for name in os.listdir(directory):
        dump = read_dump(os.path.join(directory, name))
        dump["pg_config"] = {("0" if key == "" else key): value for key, value in dump["pg_config"].items()}
        with open(os.path.join(scratch, name), "wb") as file:
            pickle.dump(dump, file)
    args = JobConfig().parse_args([scratch])
    details, version = read_dir(args)
    db = build_db(details, args, version)
    first = next(c for c in db.collectives
                 if not c.pass_check or c.missing_ranks)  # (a missing rank "passes")
    if first.missing_ranks:
        return first.collective_seq_id, "missing", sorted(first.missing_ranks)
    kinds = {
        MatchState.COLLECTIVE_TYPE_MISMATCH: "type", MatchState.SIZE_OR_SYNTAX_MISMATCH: "size",
        MatchState.COLLECTIVE_DTYPE_MISMATCH: "dtype", MatchState.COLLECTIVE_STATE_MISMATCH: "state"}
    found = {kinds[c.type_of_mismatch.state] for c in first.mismatch_collectives.values()}
    assert len(found) == 1, found
    return first.collective_seq_id, found.pop(), sorted(first.mismatch_collectives)


# -- gloo's own dumps, against torch's reader ---------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_gloo_dumps_read_as_fr_trace_reads_them(case: str, tmp_path) -> None:
    directory = os.path.join(FIXTURES, "gloo", case)
    assert fr_trace_verdict(directory, str(tmp_path)) == EXPECTED[case]
    assert verdict(directory) == EXPECTED[case]


def test_fr_trace_itself_fails_on_gloo_dumps_as_they_are() -> None:
    """Why the reference reads a corrected copy (torch 2.13): the default group's pg_config row is
    named "" while its entries say "0"; the lab's reader takes them as they are."""
    from torch.distributed.flight_recorder.components.builder import build_db
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from torch.distributed.flight_recorder.components.loader import read_dir

    args = JobConfig().parse_args([os.path.join(FIXTURES, "gloo", "skip")])
    details, version = read_dir(args)
    with pytest.raises(KeyError):
        build_db(details, args, version)


@pytest.mark.parametrize("case", CASES)
def test_lab_dumps_give_gloos_verdict(case: str) -> None:
    directory = os.path.join(FIXTURES, "lab", case)
    assert verdict(directory) == EXPECTED[case]
    dumps = read_dumps(directory)
    assert all(e["profiling_name"] == "lab:all_reduce" for d in dumps.values() for e in d["entries"])
    first = divergences(dumps)[0]
    assert "never entered" in first.doing[1] if first.kind == "missing" else "[[9]]" in first.doing[1]
    assert all("failed" in first.doing[r] for r in (0, 2, 3))  # each found the failure and dumped


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", "lab"])
@pytest.mark.parametrize("case", CASES)
def test_jobs_that_part(backend: str, case: str, tmp_path) -> None:
    """The jobs themselves, run now (4 ranks, a 3 s timeout each): gloo's dumps read as fr_trace
    reads them; the lab's failing ranks dump by themselves (the job asks only the others). Its
    ranks fork from the forkserver that started this module's lab ranks (torch and lab imported)."""
    out = str(tmp_path / "dumps")
    flight_job.run_job(backend, case, out, start_method="forkserver")
    assert verdict(out) == EXPECTED[case], report(read_dumps(out))
    if backend == "gloo":
        assert fr_trace_verdict(out, str(tmp_path / "copy")) == EXPECTED[case]


# -- the reader's verdicts, on made-up dumps ----------------------------------------------------


def entry(seq: int, name: str = "all_reduce", sizes: list | None = None, dtype: str = "Float",
          state: str = "completed", group: str = "0", record_id: int | None = None, **more) -> dict:
    sizes = [[8]] if sizes is None else sizes
    return {
        "record_id": seq if record_id is None else record_id, "pg_id": 0,
        "process_group": (group, "default_pg" if group == "0" else "undefined"), "collective_seq_id": seq,
        "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"nccl:{name}", "time_created_ns": 1000 * seq,
        "input_sizes": sizes, "output_sizes": sizes, "input_dtypes": [dtype], "output_dtypes": [dtype],
        "state": state, "is_p2p": False, "frames": [], **more}


def dumps_of(*per_rank: list[dict], groups: dict | None = None) -> dict[int, dict]:
    config = groups or {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(len(per_rank))))}}
    return {
        rank: {"version": "2.10", "pg_config": config, "entries": entries}
        for rank, entries in enumerate(per_rank)}


def first(dumps: dict) -> tuple[int, str, list[int]]:
    found = divergences(dumps)[0]
    return found.seq, found.kind, found.culprits


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_agreeing_ranks_have_no_divergence(world_size: int) -> None:
    dumps = dumps_of(*[[entry(1), entry(2), entry(3)] for _ in range(world_size)])
    assert divergences(dumps) == []
    assert "agree on every collective" in report(dumps)


def test_kinds_in_fr_traces_order() -> None:
    same = [entry(1), entry(2)]
    assert first(dumps_of(same, same, [entry(1), entry(2, "broadcast")])) == (2, "type", [2])
    assert first(dumps_of(same, [entry(1), entry(2, sizes=[[4]])], same)) == (2, "size", [1])
    assert first(dumps_of([entry(1, dtype="Double"), entry(2)], same, same)) == (1, "dtype", [0])
    assert first(dumps_of(same, same, [entry(1), entry(2, state="started")])) == (2, "state", [2])
    assert first(dumps_of(same, [entry(1)], same)) == (2, "missing", [1])
    # a type wins over the sizes it brings; a missing rank over everything
    assert first(dumps_of(same, [entry(1, "all_gather", sizes=[[2]])], [entry(1)])) == (1, "type", [1])
    assert first(dumps_of(same, [entry(1), entry(2, sizes=[[4]])], [entry(1)])) == (2, "missing", [2])


def test_lab_fields_args_and_failures() -> None:
    rooted = lambda root: entry(1, "broadcast", lab_root=root, lab_reduce_op=None)
    assert first(dumps_of([rooted(0)], [rooted(0)], [rooted(1)])) == (1, "args", [2])
    failing = [entry(1, state="started", lab_error="DeadlineError")]
    found = divergences(dumps_of(failing, failing))[0]
    assert (found.kind, found.culprits) == ("failed", []) and "every rank failed in it" in str(found)


def test_a_rank_a_later_failure_stopped_early_is_not_behind_it() -> None:
    """The lab tells a failure to every peer: a slow rank still in #2 fails there, while the others
    completed #2 and met the mismatch at #3; the records part at #3, not at #2."""
    failed = lambda seq, **k: entry(seq, state="started", lab_error="CollectiveMismatchError", **k)
    dumps = dumps_of([entry(1), entry(2), failed(3)],
                     [entry(1), entry(2), failed(3, sizes=[[9]])], [entry(1), failed(2)])
    assert first(dumps) == (3, "size", [1])
    assert "failed (CollectiveMismatchError)" in divergences(dumps)[0].doing[2]
    # a rank still in a collective the others completed, and nothing after: behind it
    assert first(dumps_of([entry(1), entry(2)], [entry(1), entry(2, state="started")])) == (2, "state", [1])


def test_a_tie_blames_the_side_without_the_lowest_rank() -> None:
    assert first(dumps_of([entry(1)], [entry(1, sizes=[[9]])])) == (1, "size", [1])


def test_rings_that_forgot_their_oldest_are_compared_where_they_overlap() -> None:
    assert divergences(dumps_of([entry(3), entry(4)], [entry(1), entry(2), entry(3), entry(4)])) == []
    assert first(
        dumps_of([entry(3), entry(4)],
                 [entry(1, sizes=[[1]]), entry(2),
                  entry(3), entry(4), entry(5)])) == (5, "missing", [0])


def test_groups_and_the_default_groups_empty_name() -> None:
    """gloo names the default group "" in pg_config and "0" in its entries; a sub-group's members
    come from its own row; each group's first divergence, the earliest entered first."""
    config = {
        "": {"name": "", "desc": "", "ranks": "[0, 1, 2]"},
        "1": {"name": "1", "desc": "x", "ranks": "[1, 2]"}}
    sub = lambda seq, **k: entry(seq, group="1", record_id=10 + seq, **k)
    dumps = dumps_of([entry(1), entry(2)], [entry(1), entry(2), sub(1)],
                     [entry(1), sub(1, sizes=[[3]])], groups=config)
    found = divergences(dumps)
    assert [(d.group, d.seq, d.kind, d.culprits) for d in found] == [("1", 1, "size", [2]),
                                                                     ("0", 2, "missing", [2])]
    assert "its last record" in found[1].doing[2]  # (its last in group 0, then the sub-group's)


def test_point_to_point_and_ranks_without_a_dump() -> None:
    p2p = {**entry(1, "send 0->1"), "is_p2p": True, "p2p_seq_id": 1, "collective_seq_id": 0}
    dumps = dumps_of([p2p, entry(1), entry(2)], [entry(1), entry(2)], [entry(1)])
    del dumps[2]
    dumps[0]["pg_config"]["0"]["ranks"] = "[0, 1, 2]"
    assert divergences(dumps) == []  # rank 2's records are unknown: nothing is said of it


def test_files_that_are_no_dump_are_refused(tmp_path) -> None:
    (tmp_path / "rank_0").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="rank_0: not a flight-recorder dump"):
        read_dumps(str(tmp_path))
    (tmp_path / "rank_0").write_bytes(pickle.dumps(os.path.join))  # would run code: refused
    with pytest.raises(ValueError, match="holds plain data"):
        read_dumps(str(tmp_path))
    (tmp_path / "rank_0").write_bytes(pickle.dumps({"entries": []}))
    with pytest.raises(ValueError, match="no 'entries' and 'pg_config'"):
        read_dumps(str(tmp_path))
    (tmp_path / "rank_0").write_bytes(pickle.dumps({"entries": [], "pg_config": {}}))
    (tmp_path / "other_1").write_bytes(b"")
    with pytest.raises(ValueError, match="several prefixes"):
        read_dumps(str(tmp_path))
    assert list(read_dumps(str(tmp_path), prefix="rank_")) == [0]
    with pytest.raises(ValueError, match="no dump named"):
        read_dumps(str(tmp_path), prefix="nccl_")


def test_the_command(tmp_path, capsys) -> None:
    """``python -m lab flight`` in a process of its own once; its --json and its refusal through
    the same ``main`` in this process (a new process costs an import of lab and torch)."""
    directory = os.path.join(FIXTURES, "gloo", "size")
    text = subprocess.run([sys.executable, "-m", "lab", "flight", directory], capture_output=True, text=True,
                          check=True).stdout
    assert "first divergence: group 0 (default_pg), collective #3: size - rank 1 passed other sizes" in text
    assert "rank 1: gloo:all_reduce #3 [[9]] Float" in text
    import json

    from lab.__main__ import main

    capsys.readouterr()
    assert main(["flight", directory, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["ranks"] == [0, 1, 2, 3] and listed["divergences"][0]["culprits"] == [1]
    with pytest.raises(SystemExit) as refused:
        main(["flight", str(tmp_path / "none")])
    assert refused.value.code == 2 and "is no folder" in capsys.readouterr().err


# -- the lab's own dumps, written ---------------------------------------------------------------


def _written(mesh: lab.Mesh, prefix: str) -> dict:
    """Collectives on the world and a sub-group, dumped on request; a mismatch, dumped on failure."""
    lab.backend.init_process_group(mesh, pg_options=lab.backend.Options(flight_dump=prefix))
    try:
        pair = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(5) * mesh.rank)
        dist.broadcast(torch.zeros(3, dtype=torch.float64), src=1)
        dist.all_gather_into_tensor(torch.empty(2 * mesh.world_size), torch.ones(2))
        if mesh.rank in (0, 1):
            dist.all_reduce(torch.ones(4, dtype=torch.int64), group=pair)
        path = flight_dumps.write_fr_trace(prefix + "asked_")
        written = pickle.loads(flight_dumps.dump_fr_trace())
        # every rank's sub-group call done first: the mismatch, told to all, would fail it otherwise
        wait_until(lambda: all(os.path.exists(f"{prefix}asked_{r}") for r in range(mesh.world_size)),
                   "every rank's asked dump")
        try:
            dist.all_reduce(torch.ones(7 if mesh.rank == mesh.world_size - 1 else 6))
        except dist.DistBackendError:
            pass
        return {"path": path, "written": written}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_lab_writes_torchs_format(world_size: int, tmp_path) -> None:
    prefix = str(tmp_path / "rank_")
    outs = lab.spawn(_written, world_size, args=(prefix,), recv_timeout_ms=20_000)
    for rank, out in enumerate(outs):
        assert out["path"] == f"{prefix}asked_{rank}"
        dump = out["written"]
        assert dump["version"] == flight_dumps.VERSION
        world = dump["pg_config"]["0"]
        assert (world["desc"], world["ranks"]) == ("default_pg", str(list(range(world_size))))
        mine = [(e["process_group"][0], e["collective_seq_id"], e["profiling_name"], e["input_sizes"],
                 e["output_sizes"], e["input_dtypes"], e["state"]) for e in dump["entries"]]
        expected = [("0", 1, "lab:all_reduce", [[5]], [[5]], ["Float"], "completed"),
                    ("0", 2, "lab:broadcast", [[3]], [[3]], ["Double"], "completed"),
                    ("0", 3, "lab:all_gather", [[2]], [[2 * world_size]], ["Float"], "completed")]
        if rank in (0, 1):
            assert dump["pg_config"]["1"]["ranks"] == "[0, 1]"
            expected.append(("1", 1, "lab:all_reduce", [[4]], [[4]], ["Long"], "completed"))
        assert sorted(mine) == sorted(expected)
        assert [e["record_id"] for e in dump["entries"]] == list(range(len(mine)))
        assert dump["entries"][0]["lab_reduce_op"] == "sum" and dump["entries"][1]["lab_root"] == 1
    assert divergences(read_dumps(str(tmp_path), prefix="rank_asked_")) == []
    # the mismatch: every rank wrote its dump by itself (Options.flight_dump), the last rank is named
    found = divergences(read_dumps(str(tmp_path), prefix="rank_"))[0]
    assert (found.seq, found.kind, found.culprits) == (4, "size", [world_size - 1])
    assert all("failed (CollectiveMismatchError)" in found.doing[r] for r in range(world_size))


def test_options_and_prefixes_are_checked(tmp_path) -> None:
    with pytest.raises(ValueError, match="is a folder"):
        lab.backend.Options(flight_dump=str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        lab.backend.Options(flight_dump=str(tmp_path / "no" / "rank_"))
    with pytest.raises(TypeError, match="flight_dump must be a path prefix"):
        lab.backend.Options(flight_dump=3)
    assert flight_dumps.check_prefix("") is None
    with pytest.raises(ValueError, match="no lab process group"):
        flight_dumps.write_fr_trace(str(tmp_path / "rank_"), groups=[])
