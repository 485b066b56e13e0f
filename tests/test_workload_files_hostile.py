"""Workload files and arguments as an attacker writes them: events whose step disagrees with the
marks, a send and its receive of different sizes, numbers past what a job can have, fields of the
wrong type, a header claiming 10**9 ranks, /dev/zero and files past the size limit, replays too
large to run; and ``python -m lab workload``'s one-line errors (exit status 2) for every bad
input. The hostile files are in tests/data/workloads/."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest

from lab import sim, workload
from lab.sim.limits import MAX_WORLD_SIZE, SimulationTooLarge
from lab.workload import calls as workload_calls
from lab.workload import format as fmt
from lab.workload.replay import Replay, template_copies, whole_steps
from lab.workload.retarget import Layout

pytestmark = pytest.mark.no_ranks

DATA = Path(__file__).parent / "data" / "workloads"
NET = sim.Network(alpha_us=10.0, gbit=8.0)


def header(world_size: int, dims: dict | None = None, version: int = 2) -> dict:
    return {
        "format": "lab-workload", "version": version, "world_size": world_size, "dims": dims, "recorded": {}}


def op(rank: int, index: int, name: str, group: list[int], count: int, step: int = 0, **extra) -> dict:
    return {
        "rank": rank, "step": step, "kind": "op", "index": index, "op": name, "group": group, "dim": None,
        "dtype": "float32", "count": count, "out_count": count, "reduce_op": None, "root": None,
        "async": False, "compute_us": 10.0, **extra}


def step_end(rank: int, step: int = 0) -> dict:
    return {"rank": rank, "step": step, "kind": "step", "compute_us": 1.0}


def allreduces(world_size: int) -> list[dict]:
    """Each rank: an allreduce of 4,000 floats on every rank, and the step's end."""
    rows = [header(world_size)]
    for rank in range(world_size):
        rows += [op(rank, 0, "allreduce", list(range(world_size)), 4000, reduce_op="sum"), step_end(rank)]
    return rows


def written(tmp_path: Path, rows: list, name: str = "w.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


# -- a step that disagrees with the marks; a send and its receive of different sizes -------------------


@pytest.mark.parametrize(("name", "line", "message"), [
    ("step_before_its_mark.jsonl", 2,
     "field 'step' must be 0 (rank 0 marked 0 step ends before this line); got 1"),
    ("step_past_the_marks.jsonl", 4,
     "field 'step' must be 1 (rank 0 marked 1 step end before this line); got 3"),])
def test_an_event_whose_step_is_not_its_rank_s_marks_is_refused_at_its_line(name, line, message):
    """Replayed, the first gave a negative step time (step_us [110, -5]), the second an IndexError."""
    with pytest.raises(ValueError) as info:
        workload.load(DATA / name)
    assert str(info.value) == f"{DATA / name}:{line}: {message}"


def test_a_send_and_its_receive_of_different_sizes_are_refused_with_both_lines():
    """4 bytes sent, 1 GB received: replayed, 20 µs or 80 ms by which rank came first in the file."""
    path = DATA / "send_and_receive_disagree.jsonl"
    with pytest.raises(ValueError) as info:
        workload.load(path)
    assert str(info.value) == (
        f"{path}:4: this recv of 1,000,000,000 bytes (rank 0 to rank 1, tag 0) pairs with the send of 4 "
        f"bytes at {path}:2: a send and its receive must carry the same bytes")


def test_sends_pair_with_receives_in_order_per_pair_and_tag(tmp_path):
    """The k-th send of a pair of ranks and a tag pairs with the k-th receive: two of each, other
    tags between them, in either order in the file, load; the second pair's sizes differing is
    named at its own line."""
    def rows(second_recv: int) -> list[dict]:
        return [
            header(2),
            op(0, 0, "send", [0, 1], 10, peer=1, tag=5),
            op(0, 1, "send", [0, 1], 99, peer=1, tag=6),
            op(0, 2, "send", [0, 1], 20, peer=1, tag=5),
            step_end(0),
            op(1, 0, "recv", [0, 1], 10, peer=0, tag=5),
            op(1, 1, "recv", [0, 1], 99, peer=0, tag=6),
            op(1, 2, "recv", [0, 1], second_recv, peer=0, tag=5),
            step_end(1)]

    good = workload.load(written(tmp_path, rows(20)))
    assert workload.replay(good, network=NET).step_us.size == 1
    reordered = rows(20)
    reordered[1:5], reordered[5:9] = reordered[5:9], reordered[1:5]
    workload.load(written(tmp_path, reordered, "reordered.jsonl"))
    with pytest.raises(
            ValueError, match=r"w\.jsonl:8: this recv of 84 bytes .*tag 5\) pairs with the send of 80 "
            r"bytes at .*w\.jsonl:4"):
        workload.load(written(tmp_path, rows(21)))


# -- every field bounded and of its type ---------------------------------------------------------------


def test_two_computes_of_1e308_are_refused_not_summed_to_inf():
    path = DATA / "compute_overflows.jsonl"
    with pytest.raises(
            ValueError, match=rf"^{path}:2: field 'compute_us' must be a finite number >= 0 of µs, "
            r"at most 3\.1536e\+13 \(MAX_US: a year\); got 1e\+308$"):
        workload.load(path)


EVENT_FIELDS = [  # (line to change: 1 the allreduce, 2 the step's end; the change; the field named)
    (1, {"compute_us": 1e300}, "compute_us"),
    (1, {"issued_us": -1.0}, "issued_us"),
    (1, {"completed_us": 1e20}, "completed_us"),
    (1, {"count": 10**30}, "count"),
    (1, {"out_count": 2**40}, "out_count"),  # 4 TiB of floats
    (1, {"count": True}, "count"),
    (1, {"count": 4.0}, "count"),
    (1, {"dim": ["dp"]}, "dim"),
    (1, {"dim": {"dp": 2}}, "dim"),
    (1, {"group": [0, True]}, "group"),
    (1, {"group": [0, 1.0]}, "group"),
    (1, {"root": True}, "root"),
    (1, {"root": 0.0}, "root"),
    (1, {"rank": True}, "rank"),
    (1, {"index": False}, "index"),
    (1, {"step": False}, "step"),
    (1, {"async": 1}, "async"),
    (1, {"reduce_op": ["sum"]}, "reduce_op"),
    (1, {"algorithm": 3}, "algorithm"),
    (1, {"split_sizes": {"in": [1, True], "out": []}}, "split_sizes"),
    (1, {"split_sizes": [1, 1]}, "split_sizes"),
    (1, {"inferred": "yes"}, "inferred"),
    (2, {"compute_us": -0.5}, "compute_us"),
    (2, {"waited_us": 1e308}, "waited_us")]


@pytest.mark.parametrize(("line", "change", "field"), EVENT_FIELDS)
def test_a_field_of_the_wrong_type_or_past_its_bounds_is_named_at_its_line(tmp_path, line, change, field):
    rows = allreduces(2)
    rows[line].update(change)
    with pytest.raises(ValueError, match=rf"w\.jsonl:{line + 1}: field '{field}' must "):
        workload.load(written(tmp_path, rows))


@pytest.mark.parametrize("tag", ["x", [1], 1.5, True, -1, 2**31])
def test_a_tag_that_is_no_p2p_tag_is_named(tmp_path, tag):
    rows = [header(2), op(0, 0, "send", [0, 1], 1, peer=1, tag=tag), step_end(0)]
    with pytest.raises(ValueError, match=r"w\.jsonl:2: field 'tag' must be an integer"):
        workload.load(written(tmp_path, rows))


@pytest.mark.parametrize(("change", "field"), [
    ({"world_size": True}, "world_size"),
    ({"world_size": MAX_WORLD_SIZE + 1}, "world_size"),
    ({"world_size": 2, "dims": {"dp": True, "tp": 2}}, "dims"),
    ({"world_size": 2, "dims": [2]}, "dims"),
    ({"recorded": [1]}, "recorded"),
    ({"version": True}, "version"),])
def test_a_header_field_of_the_wrong_type_is_named(tmp_path, change, field):
    with pytest.raises(ValueError, match=rf"w\.jsonl:1: field '{field}' "):
        workload.load(written(tmp_path, [{**header(2), **change}]))


@pytest.mark.parametrize(("change", "field"), [
    ({"counts": [1, True]}, "counts"),
    ({"counts": [2**40]}, "counts"),
    ({"bucket_cap_bytes": 2**41}, "bucket_cap_bytes"),
    ({"first_bucket_cap_bytes": True}, "first_bucket_cap_bytes"),
    ({"step": 1}, "step"),])
def test_a_gradients_field_of_the_wrong_type_or_bounds_is_named(tmp_path, change, field):
    gradients = {
        "rank": 0, "step": 0, "kind": "gradients", "group": [0], "dtype": "float32", "counts": [10],
        "bucket_cap_bytes": 100, "first_bucket_cap_bytes": 100, **change}
    with pytest.raises(ValueError, match=rf"w\.jsonl:2: field '{field}' must "):
        workload.load(written(tmp_path, [header(1), gradients]))


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_json_s_non_numbers_are_refused(tmp_path, text):
    line = json.dumps(op(0, 0, "barrier", [0], 0)).replace('"compute_us": 10.0', f'"compute_us": {text}')
    with pytest.raises(ValueError, match=r"w\.jsonl:2: (not JSON|field 'compute_us')"):
        workload.load(written(tmp_path, [header(1), line]))


def test_the_bounds_a_real_job_has_still_load(tmp_path):
    """A version-1 file at the bounds: 2**24 ranks claimed, 1 TiB an operation, a year of compute."""
    rows = [
        header(MAX_WORLD_SIZE, version=1),
        op(0, 0, "allreduce", [0], 2**40 // 4, compute_us=fmt.MAX_US, issued_us=fmt.MAX_US),
        step_end(0)]
    w = workload.load(written(tmp_path, rows))
    assert w.world_size == MAX_WORLD_SIZE and w.events[0][0].nbytes == 2**40 and w.steps == 0


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True, MAX_WORLD_SIZE + 1])
def test_replay_names_world_size_not_dims(tmp_path, world_size):
    w = workload.load(written(tmp_path, allreduces(2)))
    with pytest.raises(ValueError, match=r"^world_size must be an int in \[1, 16,777,216\]"):
        workload.replay(w, world_size, network=NET)


# -- a header that claims many ranks; files past the size limit ----------------------------------------


def test_a_header_claiming_ten_million_ranks_loads_in_little_memory():
    """95 bytes claiming 10**7 ranks took 9.7 s and 1.6 GB (a list per claimed rank)."""
    tracemalloc.start()
    try:
        w = workload.load(DATA / "ten_million_ranks.jsonl")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert w.world_size == 10**7 and w.events == {} and w.steps == 0
    assert peak < 1_000_000, peak
    with pytest.raises(ValueError, match="no whole step"):
        workload.replay(w, network=NET)


def test_a_header_claiming_a_billion_ranks_is_refused():
    path = DATA / "a_billion_ranks.jsonl"
    with pytest.raises(ValueError,
                       match=rf"^{path}:1: field 'world_size' must be an integer in \[1, 16,777,216\]"):
        workload.load(path)


def test_only_ranks_with_events_take_memory_and_a_rank_without_any_has_no_step(tmp_path):
    rows = allreduces(2)
    rows[0]["world_size"] = 1000
    for row in rows[1:]:
        row["group"] = [0, 1] if row["kind"] == "op" else None
    w = workload.load(written(tmp_path, [{k: v for k, v in row.items() if v is not None} for row in rows]))
    assert sorted(w.events) == [0, 1] and w.steps == 0  # (998 ranks marked nothing)


def test_dev_zero_is_refused_at_the_line_limit():
    with pytest.raises(
            ValueError, match=r"^/dev/zero:1: a line longer than 16,777,216 bytes "
            r"\(lab\.workload\.format\.MAX_LINE_BYTES\)"):
        workload.load("/dev/zero")


def test_a_stream_past_the_file_limit_is_refused_as_it_is_read(monkeypatch):
    monkeypatch.setattr(fmt, "MAX_FILE_BYTES", 10_000)
    monkeypatch.setattr(fmt, "MAX_LINE_BYTES", 100_000)
    with pytest.raises(
            ValueError, match=r"^/dev/zero: larger than 10,000 bytes, the most a workload may be "
            r"\(lab\.workload\.format\.MAX_FILE_BYTES\)"):
        workload.load("/dev/zero")


def test_a_file_past_the_size_limit_is_refused_before_it_is_read(tmp_path):
    """A sparse file of 2 GB (a MemoryError before): refused from its size alone."""
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as file:
        file.truncate(2 << 30)
    with pytest.raises(
            ValueError, match=rf"^{path}: 2,147,483,648 bytes, more than a workload may be "
            r"\(1,073,741,824: lab\.workload\.format\.MAX_FILE_BYTES\)"):
        workload.load(path)


def test_a_long_line_is_named_by_its_number(tmp_path, monkeypatch):
    monkeypatch.setattr(fmt, "MAX_LINE_BYTES", 1000)
    rows = [header(1), op(0, 0, "barrier", [0], 0, padding="x" * 1000)]
    with pytest.raises(ValueError, match=r"w\.jsonl:2: a line longer than 1,000 bytes"):
        workload.load(written(tmp_path, rows))


# -- replays too large, refused before they run ---------------------------------------------------------


def test_a_replay_past_max_events_is_refused_with_the_count_and_the_limit(tmp_path):
    w = workload.load(written(tmp_path, allreduces(4)))
    with pytest.raises(SimulationTooLarge) as info:
        workload.replay(w, world_size=4096, network=NET, max_events=1000)
    assert "on 4,096 ranks run 8,192 events (counted; about " in str(info.value)
    assert "past max_events=1,000. Pass max_events=8_192" in str(info.value)
    with pytest.raises(ValueError, match="max_events must be an int >= 1 or None"):
        workload.replay(w, network=NET, max_events=0)


def test_two_million_ranks_are_refused_at_once(tmp_path):
    """--ranks 2000000 was a MemoryError: 2,000,000 ranks of 2 events pass the default limit."""
    w = workload.load(written(tmp_path, allreduces(4)))
    started = time.perf_counter()
    with pytest.raises(SimulationTooLarge, match="run 4,000,000 events"):
        workload.replay(w, world_size=2_000_000, network=NET, max_events=3_000_000)
    assert time.perf_counter() - started < 10  # (counted from the recording: no pass over the ranks)


def test_a_collective_the_simulator_refuses_is_refused_before_the_ranks_are_made(tmp_path, monkeypatch):
    def never(*args):
        raise AssertionError("the replay made its ranks before the simulator refused")

    monkeypatch.setattr(workload_calls, "Replay", never)
    w = workload.load(written(tmp_path, allreduces(4)))
    with pytest.raises(SimulationTooLarge, match=r"allreduce \(ring\) on 100,000 ranks"):
        workload.replay(w, world_size=100_000, network=NET, algorithms={"allreduce": "ring"})


def test_the_events_counted_are_those_the_replay_runs(tmp_path):
    """A 2 x 2 mesh replayed on 3 x 5 (sizes no multiple of the recorded): its ranks' templates
    repeat unevenly, and the count is exact."""
    rows = [header(4, {"dp": 2, "tp": 2})]
    for rank in range(4):  # rank r: a tp allreduce, r dp allreduces, the step's end
        dp, tp = divmod(rank, 2)
        rows.append(op(rank, 0, "allreduce", [2 * dp, 2 * dp + 1], 10, dim="tp", reduce_op="sum"))
        rows += [
            op(rank, 1 + i, "allreduce", [tp, 2 + tp], 10, dim="dp", reduce_op="sum") for i in range(rank)]
        rows.append(step_end(rank))
    w = workload.load(written(tmp_path, rows))
    layout = Layout.of(w, dims={"dp": 3, "tp": 5})
    run = Replay(w, layout, NET, {}, [1.0] * 15, False)
    ran = sum(len(run.events[template]) for template in run.templates)
    copies = template_copies(w, layout)
    assert sum(n * len(whole_steps(w.events[t], w.steps)) for t, n in copies.items()) == ran
    assert copies == {0: 6, 1: 4, 2: 3, 3: 2}


# -- what held, still holds ---------------------------------------------------------------------------


def test_a_recording_whose_rank_died_and_a_cycle_of_receives_load_and_are_named_in_replay(tmp_path):
    rows = allreduces(2)
    rows += [op(rank, 1, "allreduce", [0, 1], 10, step=1, reduce_op="sum") for rank in range(2)]
    rows.append(step_end(0, step=1))  # rank 1 died in step 1, before its end
    w = workload.load(written(tmp_path, rows))
    assert w.steps == 1 and workload.replay(w, network=NET).step_us.size == 1
    died_at_once = allreduces(3)[:-2]  # rank 2 died before it wrote a line
    with pytest.raises(ValueError, match="no whole step"):
        workload.replay(workload.load(written(tmp_path, died_at_once, "died.jsonl")), network=NET)
    cycle = [
        header(2),
        op(0, 0, "recv", [0, 1], 1, peer=1),
        op(0, 1, "send", [0, 1], 1, peer=1),
        step_end(0),
        op(1, 0, "recv", [0, 1], 1, peer=0),
        op(1, 1, "send", [0, 1], 1, peer=0),
        step_end(1)]
    with pytest.raises(
            ValueError, match=r"the replay cannot go on: rank 0 waits on its op of step 0 "
            r"\(operation 0\).*\(2 ranks stuck\)"):
        workload.replay(workload.load(written(tmp_path, cycle, "cycle.jsonl")), network=NET)


# -- python -m lab workload: one line and exit status 2 for every bad input ----------------------------


def run_command(args: list[str], capsys) -> tuple[int, str, str]:
    from lab.__main__ import main

    try:
        code = main(["workload", *args])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    good = str(written(tmp_path, allreduces(4), "good.jsonl"))
    missing = str(tmp_path / "missing" / "out")
    return [
        (["replay",
          str(tmp_path / "nothing.jsonl")], f"{tmp_path / 'nothing.jsonl'}: No such file or directory"),
        (["replay", str(tmp_path)], f"{tmp_path}: Is a directory"),
        (["replay", good, "--timeline",
          f"{missing}.json"], f"argument --timeline: the folder of {missing}.json"),
        (["export", good, "--goal", f"{missing}.goal"], f"argument --goal: the folder of {missing}.goal"),
        (["export", good, "--goal", str(tmp_path)], f"argument --goal: {tmp_path} is a directory"),
        (["replay", good, "--ranks", "100000", "--algorithm", "allreduce=ring"], "too large to simulate"),
        (["replay", good, "--ranks",
          "100000000"], "argument --ranks: must be a whole number from 1 to 16,777,216"),
        (["replay", good, "--ranks", "0"], "argument --ranks: must be a whole number from 1 to 16,777,216"),
        (["replay", good, "--ranks", "2000000", "--max-events",
          "3000000"], "too large to replay: 1 step(s) of"),
        (["replay", good, "--max-events", "-1"], "argument --max-events: must be a whole number from 1 up"),
        (["replay",
          str(DATA / "dim_is_a_list.jsonl")], "dim_is_a_list.jsonl:2: field 'dim' must be a string"),
        (["replay", str(DATA / "compute_overflows.jsonl"), "--json"], "field 'compute_us' must be a finite"),
        (["replay", "/dev/zero"], "/dev/zero:1: a line longer than 16,777,216 bytes"),
        (["replay", good, "--compute-scale", "nan"], "compute_scale must be a finite number >= 0"),
        (["replay", good, "--alpha-us", "inf"], "alpha_us must be a number from 0")]


def test_every_bad_input_to_the_command_is_one_line_and_exit_status_2(tmp_path, capsys):
    for args, says in bad_inputs(tmp_path):
        code, out, err = run_command(args, capsys)
        last = err.strip().splitlines()[-1]
        assert code == 2 and out == "" and "Traceback" not in err, (args, err)
        assert last.startswith(f"python -m lab workload {args[0]}: error: ") and says in last, (args, last)
    assert not (tmp_path / "missing").exists()


def test_the_command_s_json_is_strict_json(tmp_path, capsys):
    """A step of no time (a barrier of one rank, no compute): its share is 0/0, printed as null."""
    rows = [header(1), dict(op(0, 0, "barrier", [0], 0), compute_us=0.0), dict(step_end(0), compute_us=0.0)]
    code, out, _ = run_command(["replay", str(written(tmp_path, rows)), "--json"], capsys)

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    result = json.loads(out, parse_constant=refuse)
    assert code == 0 and result["step_us"] == [0.0] and result["breakdown"][0]["share"] is None
