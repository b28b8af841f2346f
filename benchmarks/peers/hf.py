"""Hugging Face transformers ``generate``: offline, static batches with left padding, in its own venv."""

from __future__ import annotations

import pathlib

from benchmarks.peers.venv import TORCH, PeerVenv

NAME = "HF"
WORKER = pathlib.Path(__file__).resolve().parent.parent / "workers" / "hf_generate.py"
STEPS = [["install", TORCH], ["install", "transformers", "safetensors", "tokenizers", "tqdm"]]


def venv() -> PeerVenv:
    return PeerVenv("hf")


def install(log: pathlib.Path | None = None) -> PeerVenv:
    v = venv()
    v.ensure(STEPS, log=log)
    return v


def python() -> str:
    return str(install().python)


def versions() -> dict[str, str]:
    return venv().versions(["transformers", "torch", "tokenizers"])
