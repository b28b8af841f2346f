"""NameRegistry: lazy imports, aliases, clear errors; cache_dir honours XLLM_CACHE_DIR."""

from __future__ import annotations

import sys

import pytest

from xllm.common import NameRegistry, UnknownNameError, cache_dir


def test_targets_are_imported_on_first_use_only():
    sys.modules.pop("json.tool", None)
    reg = NameRegistry("codec", {"tool": "json.tool:main", "dumps": "json:dumps"})
    assert reg.names() == ["tool", "dumps"]
    assert "json.tool" not in sys.modules  # listing names imports nothing
    import json
    import json.tool

    assert reg.get("dumps") is json.dumps
    assert reg.get("tool") is json.tool.main
    assert reg.create("dumps", [1]) == "[1]"


def test_aliases_and_normalized_lookups():
    reg = NameRegistry("policy", {"kv_aware": "json:dumps"}, aliases={"kv": "kv_aware"},
                       normalize=lambda n: n.replace("-", "_"))
    assert reg.canonical("kv-aware") == reg.canonical("kv") == "kv_aware"
    assert "kv-aware" in reg and "nope" not in reg and 3 not in reg
    assert reg.choices() == ["kv_aware", "kv"]


def test_unknown_names_list_the_known_ones():
    reg = NameRegistry("KV cache backend", {"xtensor": "json:dumps", "paged": "json:loads"})
    with pytest.raises(UnknownNameError, match=r"unknown KV cache backend 'tiled'; known: xtensor, paged"):
        reg.get("tiled")
    assert isinstance(UnknownNameError("x"), ValueError)


def test_bad_entries_are_refused():
    reg = NameRegistry("thing", {"a": "json:dumps"})
    with pytest.raises(ValueError, match="not 'module:attribute'"):
        reg.register("b", "json.dumps")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", "json:loads")
    with pytest.raises(ValueError, match="unknown"):
        reg.alias("c", "missing")


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XLLM_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    assert cache_dir("models", "x") == tmp_path / "models" / "x"
    monkeypatch.delenv("XLLM_CACHE_DIR")
    assert cache_dir().parts[-2:] == (".cache", "xllm")


def test_lazy_exports_import_on_first_access(tmp_path, monkeypatch):
    pkg = tmp_path / "lazypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from xllm.common.lazy import lazy_exports\n"
        "__getattr__, __dir__ = lazy_exports(__name__, {'Heavy': 'heavy'})\n")
    (pkg / "heavy.py").write_text("class Heavy:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import lazypkg

    assert "lazypkg.heavy" not in sys.modules
    assert "Heavy" in dir(lazypkg)
    assert lazypkg.Heavy.__module__ == "lazypkg.heavy" and "lazypkg.heavy" in sys.modules
    with pytest.raises(AttributeError, match="no attribute 'Light'"):
        lazypkg.Light  # noqa: B018
