"""The GPU peer runner's own logic, without the peer installed (benchmarks/peer/peer_torchtitan.py).

TorchTitan 0.2.x, the release that imports on the GPU machines' torch 2.11, is driven through its command-line
config; its pieces are stood in for here by modules that behave as 0.2.2's do where the runner depends on them:
``ConfigManager.parse_args`` takes ``sys.argv[1:]`` as a default bound when its module is imported, and its
command line gives each option one value (a list option takes one comma-separated value)."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import pytest
from conftest import load_script

peer = load_script("benchmarks/peer/peer_torchtitan.py")

# Options of the 0.2.2 job config that take no value.
_FLAGS = {"--compile.enable"}


def _parse_like_the_peer(argv: list[str]) -> dict[str, str | bool]:
    parsed: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        key = argv[i]
        if not key.startswith("--"):
            raise SystemExit(f"Unrecognized options: {key}")  # as tyro refuses a second value
        if key in _FLAGS:
            parsed[key] = True
            i += 1
        else:
            parsed[key] = argv[i + 1]
            i += 2
    return parsed


def _stand_in_peer(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Modules named as the peer's, recording the config its Trainer was built with."""
    seen: dict[str, object] = {}

    class ConfigManager:
        def parse_args(self, args: list[str] = sys.argv[1:]) -> dict[str, str | bool]:  # noqa: B006 - 0.2.2's own
            return _parse_like_the_peer(list(args))

    class Trainer:
        def __init__(self, config: dict[str, str | bool]) -> None:
            seen["config"] = config

        def train(self) -> None:
            seen["trained"] = True

        def close(self) -> None:
            seen["closed"] = True

    def main(trainer_class: type[Trainer]) -> None:  # 0.2.2's torchtitan.train.main, in short
        trainer = trainer_class(ConfigManager().parse_args())
        trainer.train()
        trainer.close()

    flavor = types.SimpleNamespace(n_layers=32)
    modules = {
        "torchtitan.config": types.SimpleNamespace(ConfigManager=ConfigManager),
        "torchtitan.models.llama3": types.SimpleNamespace(llama3_args={"8B": flavor}),
        "torchtitan.tools.logging": types.SimpleNamespace(init_logger=lambda: None),
        "torchtitan.train": types.SimpleNamespace(Trainer=Trainer, main=main),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    seen["flavor"] = flavor
    return seen


@pytest.mark.parametrize("compile_", [False, True])
def test_run_02_hands_its_arguments_to_the_peer_config(monkeypatch, tmp_path, compile_):
    seen = _stand_in_peer(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["pytest"])
    args = argparse.Namespace(layers=3, seq=256, steps=5, warmup=2, compile=compile_, sac=False)
    peer.run_02(args, tmp_path / "tok", tmp_path / "data", tmp_path)
    config = seen["config"]
    assert isinstance(config, dict), "the peer's Trainer was not built"
    assert config["--model.hf_assets_path"] == str(tmp_path / "tok")
    assert config["--training.dataset_path"] == str(tmp_path / "data")
    assert (config["--training.seq_len"], config["--training.steps"]) == ("256", "7")
    assert config["--activation_checkpoint.mode"] == "none"
    assert config.get("--compile.enable", False) is compile_
    assert seen.get("trained") and seen.get("closed")
    assert seen["flavor"].n_layers == 3  # type: ignore[attr-defined]


def test_make_assets_text_loads_as_the_train_split_the_peer_asks_for(tmp_path):
    datasets = pytest.importorskip("datasets")
    tok_dir, data_dir = peer.make_assets(tmp_path / "assets")
    assert (tok_dir / "tokenizer.json").exists() and (tok_dir / "tokenizer_config.json").exists()
    # TorchTitan 0.2.2's c4_test loader: load_dataset(path, split="train").
    text = datasets.load_dataset(str(data_dir), split="train", cache_dir=str(tmp_path / "cache"))
    assert len(text) == 400 and text[0]["text"].startswith("w0 ")
    assert Path(data_dir).name == "c4_test"
