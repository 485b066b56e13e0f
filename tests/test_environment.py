"""The lab's integer environment variables: one parser, which names the variable and its range."""

from __future__ import annotations

import re

import pytest

from lab import checks
from lab.algorithms.double_tree_schedule import forced_segment_bytes
from lab.compiled.plane import (
    DEFAULT_MAX_BYTES,
    DEFAULT_YIELD_LIMIT,
    max_bytes_from_env,
    waiting_policy_from_env,
)
from lab.transport import peer_memory
from lab.transport.pipe_poller import DEFAULT_SPIN, spin_from_env

pytestmark = pytest.mark.no_ranks

#: Each variable, the function that reads it, and what it reads where unset.
READERS = {
    "LAB_COMPILED_SPIN": (lambda: waiting_policy_from_env(1)[0], None),
    "LAB_COMPILED_YIELD": (lambda: waiting_policy_from_env(1)[1], DEFAULT_YIELD_LIMIT),
    "LAB_COMPILED_MAX_BYTES": (max_bytes_from_env, DEFAULT_MAX_BYTES),
    "LAB_SHM_SPIN": (spin_from_env, DEFAULT_SPIN), "LAB_SHM_SCRATCH_BYTES": (peer_memory.slot_bytes_from_env,
                                                                             peer_memory.DEFAULT_SLOT_BYTES),
    "LAB_SHM_REGISTERED_BYTES": (peer_memory.arena_bytes_from_env, peer_memory.DEFAULT_ARENA_BYTES),
    "LAB_SEGMENT_BYTES": (forced_segment_bytes, None)}

#: Values no variable takes: not ASCII digits, signs, spaces, floats, and numbers past every range.
ODD = [
    "²", "٣", "-1", "+8192", " 8192", "8192 ", "8_192", "8192.0", "1e4", "0x2000", "eight",
    str(2**63),
    str(2**64 * 4096)]


@pytest.mark.parametrize("value", ODD)
@pytest.mark.parametrize("variable", sorted(READERS))
def test_an_odd_value_is_refused_naming_the_variable_and_its_range(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    read, _ = READERS[variable]
    with pytest.raises(ValueError,
                       match=rf"{variable} must be .*in \[[0-9,]+, [0-9,]+\]; got {re.escape(repr(value))}"):
        read()


@pytest.mark.parametrize("variable", sorted(READERS))
def test_a_good_value_is_read_and_an_empty_one_is_the_default(monkeypatch, variable):
    read, default = READERS[variable]
    monkeypatch.setenv(variable, "8192")
    assert read() == 8192
    monkeypatch.setenv(variable, "")
    if default is not None:
        assert read() == default


def test_byte_sizes_of_shared_memory_are_pages_and_fit_in_memory(monkeypatch):
    monkeypatch.setenv("LAB_SHM_SCRATCH_BYTES", "4097")
    with pytest.raises(ValueError, match="LAB_SHM_SCRATCH_BYTES must be a multiple of 4,096"):
        peer_memory.slot_bytes_from_env()
    monkeypatch.setenv("LAB_SHM_REGISTERED_BYTES",
                       str(2**50))  # more than this machine has: not a later ENOMEM
    with pytest.raises(ValueError, match="LAB_SHM_REGISTERED_BYTES"):
        peer_memory.arena_bytes_from_env()


def test_the_parser_takes_its_bounds(monkeypatch):
    monkeypatch.setenv("LAB_TEST_COUNT", "5")
    assert checks.env_int("LAB_TEST_COUNT", 1, low=5, high=5) == 5
    with pytest.raises(ValueError, match=r"LAB_TEST_COUNT must be an integer in \[6, 9\]; got '5'"):
        checks.env_int("LAB_TEST_COUNT", 1, low=6, high=9)
    monkeypatch.delenv("LAB_TEST_COUNT")
    assert checks.env_int("LAB_TEST_COUNT", 1) == 1
