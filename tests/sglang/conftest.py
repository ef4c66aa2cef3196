"""SGLang 0.5.23 on CPU for these tests: triton and torchvision are stubbed IN THE TEST ENV ONLY (see
sglang_cpu.py: GPU compiler / no CPU wheel for torch 2.13.0), before anything imports sglang."""
import sglang_cpu

sglang_cpu.install()
