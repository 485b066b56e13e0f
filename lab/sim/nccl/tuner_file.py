"""The configuration file of NCCL's example tuner plugin, written from a model and read back.

The plugin (``ext-tuner/example`` from NCCL 2.27.5, NVIDIA/nccl commit
3ea7eedf3b9b94f1d9f99f4e55536dfcbd23c1ca; ``plugins/tuner/example`` later) reads the file named by
``NCCL_TUNER_CONFIG_FILE`` (``nccl_tuner.conf`` by default), one rule a line:

    collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks[,numPipeOps[,regBuff]]

with ``#`` comments and blank lines skipped, fields trimmed of spaces, -1 for "any" (channels: keep
NCCL's choice), lines of at most 255 characters. The first rule that matches a call's collective,
size (``nBytes``: an allgather's or reducescatter's whole buffer) and communicator sets its pair's
cost to 0, so NCCL runs it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab import checks
from lab.sim.nccl.model import MAX_NBYTES, NcclModel, collective_name

COLLECTIVE_TYPES = ("broadcast", "reduce", "allgather", "reducescatter", "allreduce")
ALGORITHM_NAMES = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PROTOCOL_NAMES = ("ll", "ll128", "simple")
SIZE_MAX = 2**64 - 1  # the plugin's size_t: a range to the largest call
MAX_LINE = 255  # the plugin reads a line into 256 bytes, its newline included
HEADER = "collective_type,min_bytes,max_bytes,algorithm,protocol,channels,nNodes,nRanks,numPipeOps,regBuff"


@dataclass(frozen=True)
class TunerRule:
    collective: str
    min_bytes: int
    max_bytes: int
    algorithm: str
    protocol: str
    channels: int = -1
    nodes: int = -1
    ranks: int = -1
    pipe_ops: int = -1
    reg_buff: int = -1

    def line(self) -> str:
        return ",".join(
            str(v) for v in (self.collective, self.min_bytes, self.max_bytes, self.algorithm, self.protocol,
                             self.channels, self.nodes, self.ranks, self.pipe_ops, self.reg_buff))


def _switch(model: NcclModel, collective: str, nodes: int, low: int, high: int, pair_low: tuple[str,
                                                                                                str]) -> int:
    """The first size in (low, high] whose fastest pair is no longer ``pair_low`` (bisection: the
    times are affine in the size between the channel count's steps, so a few pairs alternate at most)."""
    while high - low > 1:
        middle = (low + high) // 2
        if _fastest(model, collective, nodes, middle) == pair_low:
            low = middle
        else:
            high = middle
    return high


def _fastest(model: NcclModel, collective: str, nodes: int, nbytes: int) -> tuple[str, str]:
    prediction = model.predict(collective, nodes, nbytes, choose="fastest")
    return prediction.algorithm, prediction.protocol


def rules(model: NcclModel, nodes: Iterable[Any], collectives: Iterable[str] = ("allreduce", "allgather"),
          max_bytes: int = 1 << 34) -> list[TunerRule]:
    """For each node count and collective, the byte ranges over which one pair is the model's fastest
    (:meth:`NcclModel.predict` with ``choose="fastest"``), found on powers of two up to ``max_bytes``
    and the switch points between them to the byte; the last range runs to any size."""
    if not isinstance(model, NcclModel):
        raise TypeError(f"model must be an NcclModel; got {model!r}")
    if not checks.is_int(max_bytes) or not 2 <= max_bytes <= MAX_NBYTES:
        raise ValueError(f"max_bytes must be an int in [2, 2**50]; got {max_bytes!r}")
    nodes = list(nodes)
    if not nodes:
        raise ValueError("nodes must name at least one node count")
    names = [collective_name(c) for c in collectives]
    if not names:
        raise ValueError("collectives must name at least one collective")
    out = []
    for count in nodes:
        count = model.topology.nodes(count, "nodes")
        ranks = count * model.topology.gpus_per_node
        for name in names:
            start, size = 1, 1
            pair = _fastest(model, name, count, 1)
            while size < max_bytes:
                following = min(size * 2, max_bytes)
                if _fastest(model, name, count, following) != pair:
                    switch = _switch(model, name, count, size, following, pair)
                    out.append(TunerRule(name, start, switch - 1, *pair, nodes=count, ranks=ranks))
                    start, pair = switch, _fastest(model, name, count, switch)
                size = following
            out.append(TunerRule(name, start, SIZE_MAX, *pair, nodes=count, ranks=ranks))
    return out


def write(path: str | Path, tuner_rules: Iterable[TunerRule], comment: str = "") -> Path:
    """The rules as the plugin's file, a comment first."""
    path = Path(path)
    tuner_rules = list(tuner_rules)
    for number, rule in enumerate(tuner_rules):
        if not isinstance(rule, TunerRule):
            raise TypeError(f"tuner_rules[{number}] must be a TunerRule; got {rule!r}")
    lines = [f"# {line}" for line in comment.splitlines()] + [f"# {HEADER}"]
    lines += [rule.line() for rule in tuner_rules]
    path.write_text("\n".join(lines) + "\n")
    return path


def _number(text: str, where: str, field: str, low: int, high: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{where}: {field} must be an integer; got {text!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{where}: {field} must be in [{low}, {high}]; got {value}")
    return value


def read(path: str | Path) -> list[TunerRule]:
    """The plugin's file as rules; a line the plugin would not take is an error naming the file
    and the line."""
    path = Path(path)
    out = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        where = f"{path}, line {number}"
        if len(raw) > MAX_LINE:
            raise ValueError(f"{where}: {len(raw)} characters; the plugin reads at most {MAX_LINE}")
        if not raw or raw.startswith("#"):
            continue
        fields = [field.strip(" \t") for field in raw.split(",")]
        if not 8 <= len(fields) <= 10:
            raise ValueError(f"{where}: {len(fields)} fields; a rule has 8 to 10 ({HEADER})")
        for value, field, options in ((fields[0], "collective_type", COLLECTIVE_TYPES),
                                      (fields[3], "algorithm", ALGORITHM_NAMES), (fields[4], "protocol",
                                                                                  PROTOCOL_NAMES)):
            if value not in options:
                raise ValueError(f"{where}: {field} must be one of {', '.join(options)}; got {value!r}")
        low = _number(fields[1], where, "min_bytes", 0, SIZE_MAX)
        high = _number(fields[2], where, "max_bytes", 0, SIZE_MAX)
        if low > high:
            raise ValueError(f"{where}: min_bytes {low} is past max_bytes {high}")
        names = ("channels", "nNodes", "nRanks", "numPipeOps", "regBuff")
        rest = [_number(value, where, field, -1, 2**31 - 1) for value, field in zip(fields[5:], names)]
        if len(rest) == 5 and rest[4] not in (-1, 0, 1):
            raise ValueError(f"{where}: regBuff must be -1, 0 or 1; got {rest[4]}")
        out.append(TunerRule(fields[0], low, high, fields[3], fields[4], *rest))
    return out
