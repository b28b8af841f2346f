"""xLLM-py benchmark harness: the project side by side with its peers and the machine's roofline.

Run ``python -m benchmarks --help`` from the repository root (or ``nox -s bench -- SCENARIO``).
The statistics, workload and sweep modules are pure Python so their unit tests need nothing
beyond pytest; the runners import torch/httpx/matplotlib only when they run.
"""
