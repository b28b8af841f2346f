import pytest

from benchmarks.roofline import MachineLimits, ModelShape, model_ceilings

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True}


def test_smollm2_shape():
    s = ModelShape.from_config(SMOLLM2)
    assert s.params == 134_515_008          # the checkpoint's parameter count
    assert s.flops_per_token(0) == pytest.approx(0.269e9, rel=0.01)
    assert s.weight_bytes_per_step("bfloat16") == pytest.approx(2 * s.params, rel=1e-3)
    assert s.kv_bytes_per_token("bfloat16") == 2 * 30 * 3 * 64 * 2
    untied = ModelShape.from_config({**SMOLLM2, "tie_word_embeddings": False})
    assert untied.params == s.params + 49152 * 576


def test_ceilings_bandwidth_then_compute_bound():
    s = ModelShape.from_config(SMOLLM2)
    bw, fl = 31e9, 410e9
    b1 = s.decode_ceiling(1, 96, "bfloat16", bw, fl)
    assert b1 == pytest.approx(115, rel=0.03)   # ~ bandwidth / 269 MB
    assert s.decode_ceiling(1, 96, "float32", bw, fl) == pytest.approx(b1 / 2, rel=0.02)
    big = s.decode_ceiling(64, 96, "bfloat16", bw, fl)
    assert big == pytest.approx(fl / s.flops_per_token(96), rel=1e-9)  # compute-bound at batch 64
    assert s.prefill_ceiling(32, fl) == pytest.approx(fl / s.flops_per_token(16))
    # the scenario ceiling never beats the steady-state decode ceiling by much and grows with batch
    c1, c16 = (s.scenario_ceiling(b, 32, 128, "bfloat16", bw, fl) for b in (1, 16))
    assert c1 < c16 and c1 <= b1 * 1.01


def test_model_ceilings_dict():
    lim = MachineLimits(2, 31.0, {"float32": 175.0, "bfloat16": 410.0}, {"float32": 11.0, "bfloat16": 11.0}, 2048, 256)
    c = model_ceilings(ModelShape.from_config(SMOLLM2), lim, "bfloat16")
    assert set(c["scenario_output_tok_s"]) == {"1", "16", "64"}
    assert c["decode_batch1_tok_s"] == pytest.approx(115, rel=0.03)
