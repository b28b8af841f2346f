"""The ``lora`` benchmark: its adapters are PEFT's (PEFT loads them, and they change the greedy text), its report
(table, ratios, goal line, plot) from a canned results file, and a live ``--quick`` run of xLLM on a tiny random
Llama whose adapters' greedy text is checked against Hugging Face transformers + PEFT (fp32 both sides)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import lora
from benchmarks.cli import main
from benchmarks.lora_adapters import adapter_tensors, make_adapters, step_quantiles

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}


def test_adapter_tensors_have_peft_names_and_shapes():
    t = adapter_tensors(TINY, rank=8, seed=0, b_std=0.1)
    assert len(t) == 2 * 7 * 2
    assert t["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"].shape == (8, 64)
    assert t["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (32, 8)
    assert t["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (8, 128)
    assert t["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"].shape == (64, 8)
    again = adapter_tensors(TINY, rank=8, seed=0, b_std=0.1)
    assert all(torch.equal(v, again[k]) for k, v in t.items())
    up_b = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    assert not torch.equal(t[up_b], adapter_tensors(TINY, 8, 1, 0.1)[up_b])


def test_step_quantiles_read_the_delta_between_scrapes():
    before = ("xllm:inter_token_latency_seconds", {0.01: 10.0, 0.02: 10.0, float("inf"): 10.0})
    after = ("xllm:inter_token_latency_seconds", {0.01: 10.0, 0.02: 20.0, float("inf"): 20.0})
    q = step_quantiles(before, after)
    assert q["n"] == 10 and 10.0 < q["p50_ms"] <= 20.0  # only the 10 new ones, all in (10, 20] ms
    assert step_quantiles(before, before) is None and step_quantiles(None, after) is None


def _row(tok_s: float, tpot: float, step: float | None = None) -> dict:
    return {"output_throughput": tok_s, "tpot_ms": {"p50": tpot, "p90": tpot * 1.1, "p99": tpot * 1.2},
            "ttft_ms": {"p50": 100.0}, "server_step": {"p50_ms": step} if step else None}


def test_summary_ratios_and_plot(tmp_path):
    results = {"meta": {"machine": {"cpu_model": "AMD EPYC"}, "batch": 16, "model_dir": "/m/Base"},
               "configs": ["base", "1", "16"],
               "runs": {"xllm": {"plain": _row(400, 40, 39), "base": _row(390, 41, 40), "1": _row(350, 45, 44),
                                 "16": _row(320, 50, 49)},
                        "vllm": {"plain": _row(300, 55), "base": _row(290, 56), "1": _row(200, 80),
                                 "16": _row(150, 100)}},
               "outputs": {"xllm": {"Base": "a", "lora0": "b", "lora1": "a"}}, "errors": {}}
    rat = lora.ratios(results)
    assert rat["vs_plain"]["xllm"]["16"]["tpot_p50"] == pytest.approx(50 / 40)
    assert rat["vs_base"]["vllm"]["1"]["throughput"] == pytest.approx(200 / 290)
    assert rat["xllm_vs_vllm"]["16"]["tpot_p50"] == pytest.approx(0.5)
    assert rat["vs_plain"]["vllm"]["16"]["step_p50"] is None  # no server step figure for vLLM here
    text = lora.summary(results)
    assert "AMD EPYC" in text and "| 16 | xLLM | 320 | 50.0 / 55.0 / 60.0 | 100 | 49.0 | 1.22 | 1.25 |" in text
    assert "| 16 | 0.50 | – | 2.13 |" in text
    assert "xLLM 1.25x (met)" in text and "0.50 (ahead)" in text
    assert "1 of 2 adapters' greedy text differs" in text
    (png,) = lora.plot(results, tmp_path)
    assert png.endswith("lora.png") and (tmp_path / "lora.png").stat().st_size > 1000


def test_batch_models_round_robin():
    assert lora.batch_models("B", ["a", "b", "c"], "base", 3) == ["B"] * 3
    assert lora.batch_models("B", ["a", "b", "c"], "2", 5) == ["a", "b", "a", "b", "a"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    from xllm.models import resolve_model
    from xllm.testing.models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("lora") / "tiny", resolve_model(progress=False))


@torch.inference_mode()
def _hf_greedy(model_dir, adapter, prompt: list[int], tokens: int) -> list[int]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        import peft

        hf = peft.PeftModel.from_pretrained(hf, adapter).eval()
    ids = torch.tensor([prompt])
    out = []
    for _ in range(tokens):  # greedy, EOS ignored (as the server's ignore_eos)
        nxt = int(hf(input_ids=ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def test_peft_loads_the_adapters_and_they_change_the_text(tiny, tmp_path):
    pytest.importorskip("peft")
    a, b = make_adapters(tiny, tmp_path, 2, rank=8, alpha=16, seed=0, b_std=0.3)
    prompt = list(range(100, 116))
    base = _hf_greedy(tiny, None, prompt, 8)
    assert _hf_greedy(tiny, a, prompt, 8) != base and _hf_greedy(tiny, b, prompt, 8) != base
    assert make_adapters(tiny, tmp_path, 1, rank=8, alpha=16, seed=0, b_std=0.3) == [a]  # cached


@pytest.mark.slow
def test_quick_run_live_matches_hf_peft(tiny, tmp_path, monkeypatch):
    """``lora --quick --systems xllm`` on the tiny model: every configuration measured, the report written, and
    each adapter's greedy text from the server equals HF + PEFT's on the same adapter (and differs from the
    base model's)."""
    pytest.importorskip("peft")
    import transformers

    from benchmarks.peers import venv

    monkeypatch.setattr(venv, "cache_root", lambda: tmp_path / "cache")
    out = tmp_path / "out"
    code = main(["lora", "--quick", "--systems", "xllm", "--model", str(tiny), "--dtype", "float32", "--threads",
                 "1", "--b-std", "0.3", "--out", str(out), "--xllm-args", "--kv-cache-memory 0.05"])
    results = json.loads((out / "results.json").read_text())
    assert code == 0, results["errors"]
    assert results["configs"] == ["base", "1", "2"]
    runs = results["runs"]["xllm"]
    assert set(runs) == {"base", "1", "2", "plain"}
    for name, row in runs.items():
        assert row["completed"] == 4 and row["failed"] == 0 and row["output_tokens"] == 4 * 16, name
        assert row["server_step"]["n"] > 0, name
    assert runs["2"]["models"] == ["lora0", "lora1"] and runs["base"]["models"] == ["tiny"]
    texts = results["outputs"]["xllm"]
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    for name, path in [("tiny", None), *results["adapters"].items()]:
        assert texts[name] == tok.decode(_hf_greedy(tiny, path, results["prompt"], 16)), name
    assert texts["lora0"] != texts["tiny"] and texts["lora1"] != texts["tiny"]
    assert "| 2 | xLLM |" in (out / "summary.md").read_text() and (out / "lora.png").is_file()
