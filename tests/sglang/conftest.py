"""SGLang 0.5.23 on CPU for these tests: triton and torchvision are stubbed IN THE TEST ENV ONLY, for SGLang's own
imports (sglang_cpu.py: GPU compiler / no CPU wheel for torch 2.13.0), before anything imports sglang. The
stand-ins are dropped from sys.modules after collection and after each module here, so other suites in the
same pytest session (vLLM's) never see them."""

import pytest

import sglang_cpu

sglang_cpu.install()


def pytest_collection_finish(session):
    sglang_cpu.forget()


@pytest.fixture(autouse=True, scope="module")
def _drop_stand_ins_after_module():
    yield
    sglang_cpu.forget()
