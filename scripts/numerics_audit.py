"""A pytest plugin that finds `numerics` tests whose numbers cannot depend on float32 reduction order: those that
dispatch no torch op on a float32 (or half) tensor of more than one element in the test's own process
(docs/development.md, "Test tiers"). `make test-float` reruns the marked tests under other kernels; for these it
would only repeat them. Run from the repository root:

    PYTHONPATH=scripts .venv/bin/pytest -p numerics_audit -m "numerics and not integration" -p no:cacheprovider

It prints the marked tests that dispatched none, by file. It sees the test's own thread only: a test that computes in
a subprocess or another thread is listed though it may not belong there (read it before removing its marker).
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

LOW = (torch.float32, torch.float16, torch.bfloat16)


class Spy(TorchDispatchMode):
    """Passes every op through; notes whether one had a float32 (or half) tensor argument of > 1 element."""
    seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.seen:
            self.seen = any(isinstance(a, torch.Tensor) and a.dtype in LOW and a.numel() > 1
                            for a in tree_flatten((args, kwargs))[0])
        return func(*args, **(kwargs or {}))


NONE: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    spy = Spy()
    with spy:
        yield
    if item.get_closest_marker("numerics") and not spy.seen:
        NONE.append(item.nodeid)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.section("numerics audit")
    terminalreporter.write_line(f"{len(NONE)} numerics tests dispatched no float32 op of > 1 element"
                                + (":" if NONE else ""))
    for nodeid in sorted(NONE):
        terminalreporter.write_line(f"  {nodeid}")
