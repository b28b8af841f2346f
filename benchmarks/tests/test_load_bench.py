"""The load benchmark's pieces: synthetic checkpoint size, page-cache eviction, one worker load
of each system on a tiny checkpoint, and the report table. No timings are asserted."""

import pytest

from benchmarks import load_bench


def test_synthetic_model_is_at_least_1gb_in_bf16():
    assert load_bench.synthetic_bytes(load_bench.SYNTHETIC_CONFIG) >= 1e9
    names = [n for n, _ in load_bench.synthetic_tensors(load_bench.SYNTHETIC_CONFIG)]
    assert len(names) == len(set(names)) and names[0] == "model.embed_tokens.weight"


def test_eviction_makes_a_file_cold(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"\1" * (4 << 20))
    load_bench.warm([f])
    before = load_bench.resident_fraction(f)
    left = load_bench.evict([f])
    if before is None or left is None:
        pytest.skip("mincore is unavailable here")
    assert before == 1.0
    assert left < 0.5  # tmpfs cannot drop pages; the benchmark records whatever is left


def test_workers_load_the_same_weights(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    ours = load_bench.worker("xllm", str(tmp_path), "float32", 1)
    hf = load_bench.worker("hf", str(tmp_path), "float32", 1)
    assert ours["checksum"] == pytest.approx(hf["checksum"]) and ours["seconds"] > 0 and hf["seconds"] > 0
    assert 0 <= ours["post_load_seconds"] <= ours["seconds"] and hf["post_load_seconds"] is None


def test_summary_and_markdown():
    def runs(x, h):
        return {"xllm": [{"seconds": x, "resident_before": 0.0, "checksum": 1.0}],
                "hf": [{"seconds": h, "resident_before": 0.0, "checksum": 1.0}]}

    entry = {"label": "m", "dtype": "bfloat16", "files": 4, "bytes": 1.07e9, "same_weights": True,
             "runs": {"warm": runs(1.0, 3.0), "cold": runs(2.0, 5.0)}}
    entry["summary"] = load_bench.summarize(entry)
    assert entry["summary"]["warm"]["ratio_hf_over_xllm"] == 3.0
    table = load_bench.markdown({"models": [entry], "meta": {"repeats": 1, "threads": 1, "cpu_busy_before": 0.05,
                                                             "cpu_busy_after": None, "loadavg": "0.1 0.2 0.3"}})
    assert "| m | 1.07 GB bfloat16, 4 file(s) | warm | 1.00 (min 1.00) | – | 3.00 (min 3.00) | **3.00x** | 3.00x |" \
        in table
    assert "cold (0% resident after eviction)" in table and "**2.50x**" in table
