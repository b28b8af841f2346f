"""Scripts run by path in a system's own interpreter/venv: JSON job in, JSON result out.

They import nothing from ``benchmarks`` (they may run in a venv that cannot see it). Job:
``{"model_dir", "dtype", "threads", "prompts": [[ids]], "output_lens": [n], "max_batch", "warmup"}``.
Result: ``{"versions", "load_s", "elapsed_s", "requests": [{"prompt_tokens", "output_tokens", "ttft", "e2e", "queued"}],
"steps": [{"seconds", "batch", "prefill_tokens", "decode_tokens"}]}``.
A request's ``ttft`` and ``e2e`` count from when it entered the running batch (its static batch for HF, the
engine step that admitted it for xLLM); ``queued`` is how long it waited for that since the run started.
"""
