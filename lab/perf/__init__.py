"""``python -m lab perf``: the lab's own collectives, printed as nccl-tests prints its ``*_perf`` runs.

    python -m lab perf allreduce -b 1K -e 64M -f 2 --ranks 4
    python -m lab perf allgather -b 1K -e 1M -f 4 --ranks 4 --hosts 4 --link-gbit 1   # emulated hosts
    python -m lab perf reduce_scatter -d half -o max -n 50 -w 10 --transport tcp

The options are nccl-tests' (``-b``/``-e`` sizes with K, M, G, ``-f`` factor or ``-i`` step, ``-n``
iterations, ``-w`` warm-up, ``-c`` checks, ``-o`` op, ``-d`` type, ``-r`` root, ``-a`` how ranks'
times combine), and so are the output and its conventions (common.cu, the collectives' ``*.cu``):
a size is the whole buffer (allgather's result, reduce_scatter's and alltoall's input) rounded
down to a multiple of N elements where the collective splits it, ``count`` is each rank's share
of it there, algbw = size / time and busbw = algbw · the collective's bus factor (allreduce
2(N-1)/N: :mod:`lab.catalog`, where each of these facts is written). So
``lab.sim.read_nccl_tests`` reads the output back, as a cluster's own log.

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

The package: the command line is here (its options, their checks, the run); :mod:`lab.perf.spec`
names what a run takes (:class:`Spec`), :mod:`lab.perf.data` the inputs and exact results,
:mod:`lab.perf.timing` times one size in a rank, :mod:`lab.perf.table` prints nccl-tests' text.
"""

from __future__ import annotations

import argparse
import os

from lab.algorithms import registry
from lab.catalog import COLLECTIVES as CATALOG
from lab.collectives import calls as collectives
from lab.command_line import refused, whole
from lab.errors import EmulationUnavailable
from lab.hosts.emulated import check_link_gbit
from lab.launch import launch
from lab.launch.transports import POOL_TRANSPORTS
from lab.perf.data import as_tensor, count_wrong, exact_limit, expected, layout, pattern, rank_bytes, reduced
from lab.perf.spec import AVERAGES, OPS, PROGRAMS, REDUCED_TYPES, REDUCING, TYPES, Spec
from lab.perf.table import footer, format_time, header, row, titles
from lab.perf.timing import bench_size, describe_rank, placements

#: ``lab.perf``'s names, as before it was a package (``collectives``: where a test swaps a collective).
__all__ = [
    "AVERAGES", "OPS", "PROGRAMS", "REDUCED_TYPES", "TYPES", "Spec", "add_parser", "as_tensor", "bench_size",
    "check", "collectives", "count_wrong", "describe_rank", "exact_limit", "expected", "footer",
    "format_time", "header", "layout", "parse_size", "pattern", "placements", "reduced", "row", "run",
    "sizes", "titles"]

_TYPE_ALIASES = {"float32": "float", "float64": "double", "float16": "half", "bf16": "bfloat16"}
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
#: The most sizes one run takes (``-b 1 -e 1G -i 1`` would be a billion).
MAX_SIZES = 100_000


def parse_size(text: str) -> int:
    """nccl-tests' size (its ``parsesize``): bytes, or a number with K, M or G (1024-based), from 1 up.

    >>> parse_size("1K"), parse_size("64M"), parse_size("1.5k"), parse_size("4096")
    (1024, 67108864, 1536, 4096)
    """
    number, unit = (text[:-1], _UNITS[text[-1].upper()]) if text[-1:].upper() in _UNITS else (text, 1)
    try:
        size = int(float(number) * unit)
    except (ValueError, OverflowError):  # not a number, or not a finite one (inf, 1e400)
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
    if name in REDUCING and args.datatype not in REDUCED_TYPES:
        error(f"argument -d/--datatype: the lab's {name} cannot reduce {args.datatype}; it reduces "
              f"{', '.join(REDUCED_TYPES)}")
    if name in REDUCING and args.op == "avg" and not TYPES[args.datatype].is_floating_point:
        error(f"argument -o/--op: avg needs a floating type (-d {', '.join(REDUCED_TYPES[:4])})")
    if CATALOG[name].rooted and args.root >= args.ranks:
        error(f"argument -r/--root: {args.root} is not a rank of {args.ranks} (0 to {args.ranks - 1})")
    known = registry.names(name)
    if args.algorithm != "auto" and args.algorithm not in known:
        error(f"argument --algorithm: {name} has {', '.join(known)} (or auto); got {args.algorithm!r}")
    hosts = args.hosts or 1
    if args.ranks % hosts:
        error(f"argument --hosts: {args.ranks} ranks do not split evenly over {hosts} hosts")
    if hosts > 1 and args.transport in ("shm", "queue"):
        error(f"argument --transport: ranks on {hosts} hosts talk over tcp or auto, not {args.transport}")
    transport = _transport(args)
    wire = POOL_TRANSPORTS[transport]
    if args.ranks > wire.max_world_size:
        error(f"argument --ranks: at most {wire.max_world_size} on {transport}; got {args.ranks}")
    if wire.max_ranks_per_host is not None and args.ranks // hosts > wire.max_ranks_per_host:
        error(f"argument --ranks: at most {wire.max_ranks_per_host} a host on {transport} "
              f"({wire.per_host_reason}); got {args.ranks // hosts} a host")
    _check_sizes(args)
    if args.link_gbit is not None and hosts == 1:
        error("argument --link-gbit: caps the emulated hosts' links: give --hosts H (2 or more) too")
    try:
        check_link_gbit(args.link_gbit)
    except ValueError as problem:
        error(f"argument --link-gbit: {problem}")
    algorithm = args.algorithm if registry.choosable(name) else "auto"
    return Spec(name, args.datatype, args.op if name in REDUCING else None, args.root, algorithm, args.iters,
                args.warmup_iters, args.check)


def _transport(args: argparse.Namespace) -> str:
    """The transport the run takes: ``--transport``, else shm on one host and auto on several."""
    return args.transport or ("auto" if args.hosts and args.hosts > 1 else "shm")


def _check_sizes(args: argparse.Namespace) -> None:
    """How many sizes the run takes, and whether a rank of each fits in this machine's memory at
    the largest; else the parser's error naming the option."""
    low, high, factor, step = args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes
    error = args.parser.error
    count = len(sizes(low, high, factor)) if factor > 1 else (high - low) // step + 1  # (-f's are few)
    largest = low * factor**(count - 1) if factor > 1 else low + (count - 1) * step
    per_rank = rank_bytes(largest, TYPES[args.datatype].itemsize)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if args.ranks * per_rank > memory:
        error(f"argument -e/--maxbytes: {largest:,} bytes on {args.ranks} ranks need about "
              f"{args.ranks * per_rank / 1e9:.3g} GB of memory (a rank holds about {per_rank / largest:.0f} "
              f"bytes a byte of size: its buffers, and the inputs and results it checks as int64), more than "
              f"this machine's {memory / 1e9:.3g} GB")
    if count > MAX_SIZES:
        error(f"argument -i/--stepbytes: {low:,} to {high:,} bytes in steps of {step:,} is {count:,} sizes, "
              f"more than {MAX_SIZES:,} (a larger -i, or -f)")


def run(args: argparse.Namespace) -> int:
    """``python -m lab perf``: the table on stdout, a row as each size is done; exit status 1 if
    any element was wrong, as nccl-tests."""
    spec = check(args)
    hosts = args.hosts if args.hosts and args.hosts > 1 else None
    transport = _transport(args)
    try:
        cluster = launch(args.ranks, transport=transport, hosts=hosts, link_gbit=args.link_gbit)
    except EmulationUnavailable as error:
        args.parser.error(f"argument --hosts: {error}")
    except (ValueError, OSError) as error:  # what the pool refuses besides the options (LAB_TRACE, ulimit -n)
        args.parser.error(refused(error))
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
    parser.add_argument("-f", "--stepfactor", type=whole(1), default=1, help="size factor (default 1: -i)")
    parser.add_argument("-n", "--iters", type=whole(1), default=20, help="timed calls per size (default 20)")
    parser.add_argument("-w", "--warmup_iters", type=whole(0), default=5, help="untimed calls (default 5)")
    parser.add_argument("-c", "--check", type=whole(0), default=1, help="checked calls per size, 0: none")
    parser.add_argument("-o", "--op", choices=OPS, default="sum")
    parser.add_argument("-d", "--datatype", type=_datatype, default="float", help=", ".join(TYPES))
    parser.add_argument("-r", "--root", type=whole(0), default=0, help="broadcast's and reduce's root")
    parser.add_argument("-a", "--average", type=int, choices=sorted(AVERAGES), default=1,
                        help="the ranks' times: 0 rank 0's, 1 their average (default), 2 min, 3 max")
    parser.add_argument("--ranks", type=whole(1), default=4, metavar="N", help="ranks (default 4)")
    parser.add_argument("--transport", choices=("shm", "queue", "tcp", "auto"),
                        help="default shm; auto with --hosts")
    parser.add_argument("--hosts", type=whole(1), metavar="H", help="emulated hosts, ranks split evenly")
    parser.add_argument("--link-gbit", type=float, metavar="G", help="with --hosts: link cap (default none)")
    parser.add_argument("--algorithm", default="auto", help="one of the collective's (default auto)")
    parser.set_defaults(run=run, parser=parser)
