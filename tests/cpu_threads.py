"""``one_cpu_thread``: an autouse fixture for the test modules that import it. Under Triton's interpreter a test
runs torch on one CPU thread: the interpreter's and the tests' torch calls are on tiny tensors, where the
intra-op thread pool's hand-offs cost more than they give (a file of these tests ran about a third faster on one
thread, on two cores shared by two pytest workers, as CI runs them)."""

from __future__ import annotations

import pytest
import torch

from tilegemm.core.runtime import interpreting


@pytest.fixture(autouse=True)
def one_cpu_thread():
    threads = torch.get_num_threads()
    if not interpreting() or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
