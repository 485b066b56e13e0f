"""torch's own distributed test suite (``DistributedTest`` of
``torch/testing/_internal/distributed/distributed_test.py``) against the "lab" backend.

    python tests/torch_suite.py                          # every test, WORLD_SIZE=3 (long: hours here)
    python tests/torch_suite.py -k test_all_reduce -v    # a subset (unittest's -k patterns)
    WORLD_SIZE=4 python tests/torch_suite.py -k test_broadcast

Each test starts WORLD_SIZE rank processes, forked from a forkserver that imported this module
once (torch's own test suite, and ``import lab``, which registers the backend: spawning would
import them again in every rank of every test), with the test's environment; they meet through a
file store and run the test with ``BACKEND=lab``. The lab
claims torch's "plugin", "ddp" and "subgroup" features (CPU only), so the DDP and group tests
run; the tests written for gloo or NCCL by name skip, and say so. tests/test_backend.py runs a
chosen subset in CI.
"""

import os
import sys
import tempfile

import torch.multiprocessing

os.environ["BACKEND"] = "lab"
# torch's run_tests writes JUnit XML through xmlrunner (not a dependency) whenever $CI is set; a CI
# machine running this file must get the plain unittest report the lab's test reads.
os.environ.pop("CI", None)
os.environ.setdefault("WORLD_SIZE", "3")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="lab-torch-suite-"))

from torch.testing._internal.common_distributed import DistTestCases

for feature in ("plugin", "ddp", "subgroup"):  # before distributed_test reads them at import
    DistTestCases.backend_feature[feature].add("lab")

from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed import distributed_test
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

import lab  # noqa: F401 - registers "lab" here and in every spawned rank


def _in_environment(environ: dict[str, str], target, *args, **kwargs) -> None:
    """A rank: the test's environment (set up per test, after the forkserver started), and what
    distributed_test read of it at import, then the test."""
    os.environ.clear()
    os.environ.update(environ)
    distributed_test.INIT_METHOD = os.getenv("INIT_METHOD", "env://")
    target(*args, **kwargs)


def _forked_rank(target, name: str, args: tuple, kwargs: dict) -> torch.multiprocessing.Process:
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__"])
    return context.Process(target=_in_environment, name=name, args=(dict(os.environ), target, *args),
                           kwargs=kwargs)


class TestLabBackend(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._start_processes(_forked_rank)


if __name__ == "__main__":
    sys.exit(run_tests())
