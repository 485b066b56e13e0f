"""torch's own distributed test suite (``DistributedTest`` of
``torch/testing/_internal/distributed/distributed_test.py``) against the "lab" backend.

    python tests/torch_suite.py                          # every test, WORLD_SIZE=3 (long: hours here)
    python tests/torch_suite.py -k test_all_reduce -v    # a subset (unittest's -k patterns)
    WORLD_SIZE=4 python tests/torch_suite.py -k test_broadcast

Each test spawns WORLD_SIZE rank processes that import this module (so ``import lab`` registers
the backend in each), meet through a file store and run the test with ``BACKEND=lab``. The lab
claims torch's "plugin", "ddp" and "subgroup" features (CPU only), so the DDP and group tests
run; the tests written for gloo or NCCL by name skip, and say so. tests/test_backend.py runs a
chosen subset in CI.
"""

import os
import sys
import tempfile

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
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

import lab  # noqa: F401 - registers "lab" here and in every spawned rank


class TestLabBackend(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    sys.exit(run_tests())
