"""``python -m lab perf``: the lab's own collectives, printed as nccl-tests prints its ``*_perf`` runs.

    python -m lab perf allreduce -b 1K -e 64M -f 2 --ranks 4
    python -m lab perf allgather -b 1K -e 1M -f 4 --ranks 4 --hosts 4 --link-gbit 1   # emulated hosts
    python -m lab perf reduce_scatter -d half -o max -n 50 -w 10 --transport tcp

The options are nccl-tests' (``-b``/``-e`` sizes with K, M, G, ``-f`` factor or ``-i`` step, ``-n``
iterations, ``-w`` warm-up, ``-c`` checks, ``-o`` op, ``-d`` type, ``-r`` root, ``-a`` how ranks'
times combine), and so are the output and its conventions (common.cu, the collectives' ``*.cu``):
a size is the whole buffer (allgather's result, reduce_scatter's and alltoall's input) rounded
down to a multiple of N elements where the collective splits it, ``count`` is each rank's share
of it there, algbw = size / time and busbw = algbw · (allreduce 2(N-1)/N; allgather,
reduce_scatter, alltoall (N-1)/N; broadcast, reduce 1). So ``lab.sim.read_nccl_tests`` reads the
output back, as a cluster's own log.

Out of place and in place, for the lab. ``lab.allreduce``, ``broadcast`` and ``reduce`` work in
place: in place is the call on the tensor holding the input; out of place copies the send
buffer into the receive buffer and calls on that (the copy is timed: it is what an out-of-place
call costs in the lab). ``allgather``, ``reduce_scatter`` and ``all_to_all`` return a new
tensor: out of place is that call; in place is nccl-tests' layout, the input a view of the
receive buffer (allgather: this rank's block of it) and the result copied into the receive
buffer (reduce_scatter: into this rank's block), the copy timed.

Timing is nccl-tests': inside the ranks, ``-w`` untimed calls (at every size and placement: a
first call at a new shape prepares the lab's lane), a barrier, then ``-n`` calls back to back,
timed as one: time = total / n, combined over ranks by ``-a`` (1, the default: the average).
Process start is never timed. Each check (``-c``) refills the inputs, runs once and compares
every element on every rank, bit for bit, with the exact result; ``#wrong`` is the sum over
ranks (``N/A`` with ``-c 0``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import time
from collections.abc import Callable

import numpy as np
import torch

from lab.benchmark import bus_factor
from lab.collectives import calls as collectives
from lab.collectives import registry
from lab.hosts import check_link_gbit
from lab.mesh import Mesh

#: The collectives perf runs, by the lab's name, and the nccl-tests program each is.
PROGRAMS = {"allreduce": "all_reduce_perf", "allgather": "all_gather_perf",
            "reduce_scatter": "reduce_scatter_perf", "broadcast": "broadcast_perf",
            "all_to_all": "alltoall_perf", "reduce": "reduce_perf"}
#: nccl-tests' type names (``-d``), as its type column prints them.
TYPES = {"int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "uint32": torch.uint32,
         "int64": torch.int64, "uint64": torch.uint64, "half": torch.float16, "float": torch.float32,
         "double": torch.float64, "bfloat16": torch.bfloat16}
_TYPE_ALIASES = {"float32": "float", "float64": "double", "float16": "half", "bf16": "bfloat16"}
#: The types the lab's reductions take (the others it only moves).
REDUCED_TYPES = ("float", "double", "half", "bfloat16", "int32", "int64")
OPS = ("sum", "prod", "max", "min", "avg")
#: Collectives whose result is a new tensor (the others work in place), and which reduce.
_RETURNING = ("allgather", "reduce_scatter", "all_to_all")
_REDUCING = ("allreduce", "reduce_scatter", "reduce")
#: How ``-a`` combines the ranks' times, as nccl-tests numbers it.
AVERAGES = {0: lambda times: times[0], 1: lambda times: sum(times) / len(times), 2: min, 3: max}
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One perf run's settings, as every rank gets them (``op`` None: the collective reduces nothing)."""

    collective: str
    dtype: str = "float"
    op: str | None = "sum"
    root: int = 0
    algorithm: str = "auto"
    iters: int = 20
    warmup: int = 5
    check: int = 1


def parse_size(text: str) -> int:
    """nccl-tests' size (its ``parsesize``): bytes, or a number with K, M or G (1024-based), from 1 up.

    >>> parse_size("1K"), parse_size("64M"), parse_size("1.5k"), parse_size("4096")
    (1024, 67108864, 1536, 4096)
    """
    number, unit = (text[:-1], _UNITS[text[-1].upper()]) if text[-1:].upper() in _UNITS else (text, 1)
    try:
        size = int(float(number) * unit)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: bytes from 1 up, optionally with K, M or G")
    return size


def sizes(min_bytes: int, max_bytes: int, factor: int = 1, step: int = 1 << 20) -> list[int]:
    """The sizes nccl-tests runs: from ``min_bytes``, times ``factor`` (if above 1, else plus
    ``step``), up to ``max_bytes``.

    >>> sizes(1024, 16384, 2)
    [1024, 2048, 4096, 8192, 16384]
    """
    out = [min_bytes]
    while (out[-1] * factor if factor > 1 else out[-1] + step) <= max_bytes:
        out.append(out[-1] * factor if factor > 1 else out[-1] + step)
    return out


def layout(collective: str, nbytes: int, world_size: int, itemsize: int) -> tuple[int, int]:
    """``(size, count)`` as nccl-tests prints them for ``nbytes`` (its getCollByteCount): where the
    collective splits the buffer in N, count is each rank's share and size N shares.

    >>> layout("allreduce", 1024, 3, 4), layout("allgather", 1024, 3, 4)
    ((1024, 256), (1020, 85))
    """
    count = nbytes // itemsize
    if collective in _RETURNING:
        count //= world_size
        return count * world_size * itemsize, count
    return count * itemsize, count


def exact_limit(dtype: str) -> int:
    """The integers up to which ``dtype`` holds every one exactly (its largest, for integer types)."""
    torch_dtype = TYPES[dtype]
    if torch_dtype.is_floating_point:
        return 2 * round(1 / torch.finfo(torch_dtype).eps)  # 2 ** (mantissa bits + 1)
    return int(torch.iinfo(torch_dtype).max)


def _period(world_size: int, op: str | None, limit: int) -> int:
    """How many indices the pattern runs before it repeats: every partial result stays exact."""
    power = {"sum": 2, "avg": 3}.get(op or "", 1)  # a sum of N values; avg's values carry a factor N more
    return max(1, min(1 << 20, limit // world_size ** power))


def pattern(index: np.ndarray, rank: int, world_size: int, op: str | None, limit: int) -> np.ndarray:
    """A rank's inputs at ``index`` (int64): ``(index mod P)·N + rank``, distinct for every rank and
    index within a period of P (so a block in the wrong place shows), times N for avg (so each
    rank's share, and the average, is an integer); for prod 1 or 2, so products are powers of two.
    P keeps every partial result an exact integer of the type, whatever order the algorithm adds in.

    >>> pattern(np.arange(4), rank=1, world_size=2, op="sum", limit=2 ** 24).tolist()
    [1, 3, 5, 7]
    """
    if op == "prod":
        return 1 + (index + rank) % 2
    values = (index % _period(world_size, op, limit)) * world_size + rank
    return values * world_size if op == "avg" else values


def reduced(index: np.ndarray, world_size: int, op: str, limit: int) -> np.ndarray:
    """The exact reduction of every rank's :func:`pattern` at ``index``, in closed form (a rank's
    check would otherwise build all N ranks' inputs).

    >>> reduced(np.arange(4), world_size=2, op="sum", limit=2 ** 24).tolist()
    [1, 5, 9, 13]
    """
    n = world_size
    if op == "prod":  # 2 ** (the ranks whose index + rank is odd)
        return np.where(index % 2 == 0, 1 << (n // 2), 1 << ((n + 1) // 2)).astype(np.int64)
    base = (index % _period(n, op, limit)) * n
    return {"min": base, "max": base + n - 1}.get(op, n * base + n * (n - 1) // 2)  # sum; avg = sum of x/N


def as_tensor(values: np.ndarray, dtype: str) -> torch.Tensor:
    """Exact integers as a tensor of nccl-tests type ``dtype``."""
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(TYPES[dtype])


def count_wrong(result: torch.Tensor, expected: torch.Tensor) -> int:
    """Elements of ``result`` that are not ``expected``'s, bit for bit (all of them where the
    shapes differ).

    >>> count_wrong(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.5, 3.0]))
    1
    """
    if result.shape != expected.shape or result.dtype != expected.dtype:
        return max(result.numel(), expected.numel())
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[result.element_size()]
    return int((result.reshape(-1).view(bits) != expected.reshape(-1).view(bits)).sum())


def expected(spec: Spec, count: int, rank: int, world_size: int) -> torch.Tensor:
    """What rank ``rank`` holds after the collective, each rank's input its :func:`pattern` over
    ``count`` elements (allgather) or N·count (reduce_scatter, alltoall)."""
    n, limit, op, name = world_size, exact_limit(spec.dtype), spec.op, spec.collective
    own = np.arange(count, dtype=np.int64)  # indices of the elements this rank ends up with
    block = own + rank * count  # ... and of its block in every rank's input (reduce_scatter, alltoall)
    if name == "allreduce" or (name == "reduce" and rank == spec.root):
        values = reduced(own, n, op, limit)
    elif name in ("broadcast", "reduce"):  # reduce: the others' tensors are left as they were
        values = pattern(own, spec.root if name == "broadcast" else rank, n, op, limit)
    elif name == "reduce_scatter":
        values = reduced(block, n, op, limit)
    elif name == "allgather":
        values = np.concatenate([pattern(own, j, n, op, limit) for j in range(n)])
    else:  # all_to_all
        values = np.concatenate([pattern(block, j, n, op, limit) for j in range(n)])
    return as_tensor(values, spec.dtype)


def _operation(mesh: Mesh, spec: Spec) -> Callable[[torch.Tensor], torch.Tensor]:
    """The collective as one call on a tensor, returning the tensor that holds the result."""
    name, options = spec.collective, {"algorithm": spec.algorithm}
    if name in _REDUCING:
        options["op"] = spec.op
    if name == "broadcast":
        options["src"] = spec.root
    if name == "reduce":  # one algorithm, no argument
        return lambda tensor: collectives.reduce(mesh, tensor, dst=spec.root, op=spec.op)
    call = getattr(collectives, name)
    return lambda tensor: call(mesh, tensor, **options)


def placements(mesh: Mesh, spec: Spec, count: int) -> dict[str, tuple[Callable[[], torch.Tensor], Callable]]:
    """``{"oop": (call, fill), "ip": (call, fill)}``: ``call()`` runs the collective once, out of
    place or in place (the module's docstring says what each is in the lab), and returns the
    tensor to check; ``fill()`` writes this rank's inputs where the next call reads them."""
    n, rank, op = mesh.world_size, mesh.rank, _operation(mesh, spec)
    inputs = count if spec.collective in ("allreduce", "broadcast", "reduce", "allgather") else n * count
    send = as_tensor(pattern(np.arange(inputs), rank, n, spec.op, exact_limit(spec.dtype)), spec.dtype)
    if spec.collective not in _RETURNING:
        recv = torch.empty_like(send)

        def out_of_place() -> torch.Tensor:
            return op(recv.copy_(send))

        return {"oop": (out_of_place, lambda: None), "ip": (lambda: op(recv), lambda: recv.copy_(send))}
    recv = torch.empty(n * count, dtype=send.dtype)
    mine = recv[rank * count:(rank + 1) * count]  # this rank's block of the receive buffer
    source = mine if spec.collective == "allgather" else recv  # nccl-tests' in-place offsets
    target = mine if spec.collective == "reduce_scatter" else recv

    def in_place() -> torch.Tensor:
        return target.copy_(op(source))

    return {"oop": (lambda: op(send), lambda: None), "ip": (in_place, lambda: source.copy_(send))}


def bench_size(mesh: Mesh, spec: Spec, nbytes: int) -> dict[str, tuple[float, int]]:
    """In one rank: ``{"oop": (µs per call, wrong elements), "ip": (...)}`` at ``nbytes``
    (wrong -1 without checks). Every rank makes the same calls: the checks never stop early."""
    _, count = layout(spec.collective, nbytes, mesh.world_size, TYPES[spec.dtype].itemsize)
    want = expected(spec, count, mesh.rank, mesh.world_size) if spec.check else None
    out = {}
    for name, (call, fill) in placements(mesh, spec, count).items():
        fill()
        for _ in range(spec.warmup):
            call()
        collectives.barrier(mesh)  # start together: the loop's time is then the collectives'
        start = time.perf_counter_ns()
        for _ in range(spec.iters):
            call()
        elapsed_us = (time.perf_counter_ns() - start) / 1e3 / spec.iters
        wrong = -1
        for _ in range(spec.check):
            fill()
            wrong = max(wrong, count_wrong(call(), want))
        out[name] = (elapsed_us, wrong)
    return out


def describe_rank(mesh: Mesh) -> tuple[int, int, str, int]:
    """``(rank, pid, host, device)`` for the "Using devices" lines: an emulated host's name is the
    machine's with ``-h<host>`` (so a reader counts the hosts), the device the local rank."""
    host = socket.gethostname() + (f"-h{mesh.host}" if mesh.host_count > 1 else "")
    return mesh.rank, os.getpid(), host, mesh.local_rank


def format_time(us: float) -> str:
    """A time as nccl-tests prints it: 7 wide, 2 decimals below 100 µs, 1 below 10,000, then none."""
    return f"{us:7.0f}" if us >= 10000 else f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


def titles() -> list[str]:
    """nccl-tests' three lines of column titles (common.cu's Reporter), to the character."""
    widths = (10, 12, 8, 6, 6, *(7, 6, 6, 7) * 2)  # #wrong: 7 wide, no gap before it
    gaps = ("", *["  "] * 7, "", "  ", "  ", "  ", "")
    names = ("size", "count", "type", "redop", "root", *("time", "algbw", "busbw", "#wrong") * 2)
    units = ("(B)", "(elements)", "", "", "", *("(us)", "(GB/s)", "(GB/s)", "") * 2)
    lines = [zip(gaps, texts, widths) for texts in (names, units)]
    titled = ["# " + "".join(f"{gap}{text:>{width}}" for gap, text, width in line) for line in lines]
    return ["# " + " " * 61 + "out-of-place" + " " * 23 + "in-place" + " " * 10, *titled]


def header(spec: Spec, args: argparse.Namespace, ranks: list[tuple], transport: str) -> str:
    """nccl-tests' lines above the table: the program, the parameters, the devices, the column titles."""
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    hosts = len({host for _, _, host, _ in ranks})
    lines = [f"# Collective test starting: {PROGRAMS[spec.collective]}",
             (f"# nThread 1 nGpus 1 minBytes {args.minbytes} maxBytes {args.maxbytes} step: {step} "
              f"warmup iters: {spec.warmup} iters: {spec.iters} agg iters: 1 "
              f"validation: {spec.check} graph: 0"),
             (f"# lab: python -m lab perf, transport {transport}, algorithm {spec.algorithm}, "
              f"{len(ranks)} ranks on {hosts} host(s), link {_link(args)}, {os.cpu_count()} cores"),
             "#", "# Using devices"]
    lines += [f"#  Rank {rank:2d} Group  0 Pid {pid:6d} on {host:>10s} device {device:2d} [cpu] "
              f"lab-{transport}" for rank, pid, host, device in ranks]
    return "\n".join([*lines, "#", *titles()])


def _link(args: argparse.Namespace) -> str:
    """What links the ranks: ``1 Gbit/s each way`` between emulated hosts."""
    return "none (one host)" if not args.hosts or args.hosts == 1 else (
        f"{args.link_gbit:g} Gbit/s each way" if args.link_gbit else "uncapped")


def row(spec: Spec, nbytes: int, per_rank: list[dict[str, tuple[float, int]]],
        average: int = 1) -> tuple[str, list[float], int]:
    """One size's row as nccl-tests prints it, its two busbw and how many of its two runs were wrong.

    >>> row(Spec("allreduce"), 1024, [{"oop": (10.0, 0), "ip": (9.0, 0)}] * 2)[0].split()
    ['1024', '256', 'float', 'sum', '-1', '10.00', '0.10', '0.10', '0', '9.00', '0.11', '0.11', '0']
    """
    n = len(per_rank)
    size, count = layout(spec.collective, nbytes, n, TYPES[spec.dtype].itemsize)
    root = spec.root if spec.collective in ("broadcast", "reduce") else -1
    text = f"{size:12d}  {count:12d}  {spec.dtype:>8s}  {spec.op or 'none':>6s}  {root:6d}"
    busbws, failed = [], 0
    for name in ("oop", "ip"):
        us = AVERAGES[average]([rank[name][0] for rank in per_rank])
        algbw = size / (us * 1e3) if us > 0 else 0.0  # GB/s
        busbws.append(algbw * bus_factor(spec.collective, n))
        wrong = sum(rank[name][1] for rank in per_rank)
        shown = "N/A" if wrong < 0 else wrong
        text += f"  {format_time(us):>7s}  {algbw:6.2f}  {busbws[-1]:6.2f}  {shown:>5}"
        failed += wrong > 0
    return text, busbws, failed


def footer(busbws: list[float], failed: int) -> str:
    """nccl-tests' last lines: runs with wrong elements, and the average busbw of every run."""
    average = sum(busbws) / len(busbws) if busbws else 0.0
    return (f"# Out of bounds values : {failed} {'FAILED' if failed else 'OK'}\n"
            f"# Avg bus bandwidth    : {average:g} \n#")


def _whole(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` up (the error names the option, before anything runs)."""
    def whole(text: str) -> int:
        if not text.isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"must be a whole number from {low} up; got {text!r}")
        return int(text)
    return whole


def _collective(text: str) -> str:
    """The lab's name of a collective, given it or nccl-tests' (``alltoall``, ``all_reduce_perf``)."""
    names = {name.replace("_", ""): name for name in PROGRAMS}
    named = names.get(text.removesuffix("_perf").replace("_", "").lower())
    if named is None:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(PROGRAMS)} (or nccl-tests' names: "
                                         f"all_reduce, alltoall, ...); got {text!r}")
    return named


def _datatype(text: str) -> str:
    """nccl-tests' name of a type (``-d float``; torch's ``float32``, ``float16``, ``float64`` too)."""
    name = _TYPE_ALIASES.get(text, text)
    if name not in TYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(TYPES)}; got {text!r}")
    return name


def check(args: argparse.Namespace) -> Spec:
    """The run's :class:`Spec`, once the options agree with each other; else the parser's error
    naming the option (exit status 2), before any rank starts."""
    name, error = args.collective, args.parser.error
    if args.maxbytes < args.minbytes:
        error(f"argument -e/--maxbytes: {args.maxbytes} bytes is below -b/--minbytes ({args.minbytes})")
    if name in _REDUCING and args.datatype not in REDUCED_TYPES:
        error(f"argument -d/--datatype: the lab's {name} cannot reduce {args.datatype}; it reduces "
              f"{', '.join(REDUCED_TYPES)}")
    if name in _REDUCING and args.op == "avg" and not TYPES[args.datatype].is_floating_point:
        error(f"argument -o/--op: avg needs a floating type (-d {', '.join(REDUCED_TYPES[:4])})")
    if name in ("broadcast", "reduce") and args.root >= args.ranks:
        error(f"argument -r/--root: {args.root} is not a rank of {args.ranks} (0 to {args.ranks - 1})")
    known = registry.names(name)
    if args.algorithm != "auto" and args.algorithm not in known:
        error(f"argument --algorithm: {name} has {', '.join(known)} (or auto); got {args.algorithm!r}")
    hosts = args.hosts or 1
    if args.ranks % hosts:
        error(f"argument --hosts: {args.ranks} ranks do not split evenly over {hosts} hosts")
    if hosts > 1 and args.transport in ("shm", "queue"):
        error(f"argument --transport: ranks on {hosts} hosts talk over tcp or auto, not {args.transport}")
    if args.link_gbit is not None and hosts == 1:
        error("argument --link-gbit: caps the emulated hosts' links: give --hosts H (2 or more) too")
    try:
        check_link_gbit(args.link_gbit)
    except ValueError as problem:
        error(f"argument --link-gbit: {problem}")
    algorithm = args.algorithm if registry.choosable(name) else "auto"
    return Spec(name, args.datatype, args.op if name in _REDUCING else None, args.root, algorithm,
                args.iters, args.warmup_iters, args.check)


def run(args: argparse.Namespace) -> int:
    """``python -m lab perf``: the table on stdout, a row as each size is done; exit status 1 if
    any element was wrong, as nccl-tests."""
    import lab  # (lab.launch at call time: a test stands in for it)

    spec = check(args)
    hosts = args.hosts if args.hosts and args.hosts > 1 else None
    transport = args.transport or ("auto" if hosts else "shm")
    try:
        cluster = lab.launch(args.ranks, transport=transport, hosts=hosts, link_gbit=args.link_gbit)
    except lab.EmulationUnavailable as error:
        args.parser.error(f"argument --hosts: {error}")
    busbws, failed = [], 0
    with cluster:
        print(header(spec, args, cluster.run(describe_rank), transport), flush=True)
        for nbytes in sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes):
            text, busbw, wrong = row(spec, nbytes, cluster.run(bench_size, spec, nbytes), args.average)
            print(text, flush=True)
            busbws, failed = busbws + busbw, failed + wrong
    print(footer(busbws, failed), flush=True)
    return 1 if failed else 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """``python -m lab perf``, nccl-tests' options and the lab's own (ranks, transport, hosts, algorithm)."""
    parser = commands.add_parser("perf", help="the lab's collectives as nccl-tests tables (all_reduce_perf)",
                                 description=__doc__.split("\n\n")[2].replace("\n", " "))
    parser.add_argument("collective", type=_collective, help=", ".join(PROGRAMS))
    size = {"type": parse_size, "metavar": "BYTES"}
    parser.add_argument("-b", "--minbytes", default=32 << 20, help="smallest size (default 32M)", **size)
    parser.add_argument("-e", "--maxbytes", default=32 << 20, help="largest size (default 32M)", **size)
    parser.add_argument("-i", "--stepbytes", default=1 << 20, help="step without -f (default 1M)", **size)
    parser.add_argument("-f", "--stepfactor", type=_whole(1), default=1, help="size factor (default 1: -i)")
    parser.add_argument("-n", "--iters", type=_whole(1), default=20, help="timed calls per size (default 20)")
    parser.add_argument("-w", "--warmup_iters", type=_whole(0), default=5, help="untimed calls (default 5)")
    parser.add_argument("-c", "--check", type=_whole(0), default=1, help="checked calls per size, 0: none")
    parser.add_argument("-o", "--op", choices=OPS, default="sum")
    parser.add_argument("-d", "--datatype", type=_datatype, default="float", help=", ".join(TYPES))
    parser.add_argument("-r", "--root", type=_whole(0), default=0, help="broadcast's and reduce's root")
    parser.add_argument("-a", "--average", type=int, choices=sorted(AVERAGES), default=1,
                        help="the ranks' times: 0 rank 0's, 1 their average (default), 2 min, 3 max")
    parser.add_argument("--ranks", type=_whole(1), default=4, metavar="N", help="ranks (default 4)")
    parser.add_argument("--transport", choices=("shm", "queue", "tcp", "auto"),
                        help="default shm; auto with --hosts")
    parser.add_argument("--hosts", type=_whole(1), metavar="H", help="emulated hosts, ranks split evenly")
    parser.add_argument("--link-gbit", type=float, metavar="G", help="with --hosts: link cap (default none)")
    parser.add_argument("--algorithm", default="auto", help="one of the collective's (default auto)")
    parser.set_defaults(run=run, parser=parser)
