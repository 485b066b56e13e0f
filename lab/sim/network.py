"""The network the simulator times messages on: α per message, β per byte, one link each way per host."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _check_number(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}; got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Network:
    """A cluster as the simulator sees it.

    A message of n bytes costs ``alpha_us + n * 8 / (gbit * 1e3)`` µs. Each rank sends one message
    at a time and receives one at a time, both directions at once (full duplex). With
    ``ranks_per_host`` > 1, ranks ``[h*L, (h+1)*L)`` share host h: a message between two hosts
    also holds the sender's host uplink and the receiver's host downlink for its whole duration,
    and a message inside a host costs ``intra_alpha_us + n * 8 / (intra_gbit * 1e3)`` (both
    default to the inter-host values). ``gamma_us_per_byte`` (default 0): time to reduce a
    received byte into the local buffer, added after a reducing receive arrives.

        lab.sim.Network(alpha_us=20.0, gbit=10.0)     # 1 MB: 20 + 838.9 µs per message
    """

    alpha_us: float = 20.0
    gbit: float = 10.0
    ranks_per_host: int = 1
    intra_alpha_us: float | None = None
    intra_gbit: float | None = None
    gamma_us_per_byte: float = 0.0

    def __post_init__(self) -> None:
        _check_number("alpha_us", self.alpha_us, positive=False)
        _check_number("gbit", self.gbit, positive=True)
        if isinstance(self.ranks_per_host, bool) or not isinstance(self.ranks_per_host, int) or self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be an integer >= 1; got {self.ranks_per_host!r}")
        if self.intra_alpha_us is not None:
            _check_number("intra_alpha_us", self.intra_alpha_us, positive=False)
        if self.intra_gbit is not None:
            _check_number("intra_gbit", self.intra_gbit, positive=True)
        _check_number("gamma_us_per_byte", self.gamma_us_per_byte, positive=False)

    @property
    def beta_us_per_byte(self) -> float:
        """µs per byte between hosts: 8 / (gbit · 1e3)."""
        return 8.0 / (self.gbit * 1e3)

    @property
    def intra_alpha(self) -> float:
        return self.alpha_us if self.intra_alpha_us is None else float(self.intra_alpha_us)

    @property
    def intra_beta_us_per_byte(self) -> float:
        return 8.0 / ((self.gbit if self.intra_gbit is None else self.intra_gbit) * 1e3)

    def message_us(self, nbytes: int, *, intra: bool = False) -> float:
        """The time of one message of ``nbytes`` bytes on an idle link."""
        if intra:
            return self.intra_alpha + nbytes * self.intra_beta_us_per_byte
        return self.alpha_us + nbytes * self.beta_us_per_byte

    def describe(self) -> str:
        """``α 20 µs, 10 Gbit/s`` (and the host structure when there is one)."""
        text = f"α {self.alpha_us:g} µs, {self.gbit:g} Gbit/s"
        if self.ranks_per_host > 1:
            intra_gbit = self.gbit if self.intra_gbit is None else self.intra_gbit
            text += f", {self.ranks_per_host} ranks/host (inside: α {self.intra_alpha:g} µs, {intra_gbit:g} Gbit/s)"
        if self.gamma_us_per_byte:
            text += f", γ {self.gamma_us_per_byte:g} µs/B"
        return text
