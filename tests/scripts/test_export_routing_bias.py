"""An export is the trained model, or it is refused: a MoE trained with the auxiliary-loss-free routing bias
cannot be written to a Hugging Face format that has no place for it (Qwen3-MoE, Mixtral, GPT-OSS), and each
family's default balancing is one its format holds."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, debug_config, load_script, torchrun_env

from torchtitan.checkpoint.formats import routing_bias_problem
from torchtitan.models import get_model_spec
from torchtitan.preflight import preflight

MOE_CONFIGS = {"qwen3": "qwen3_debug_moe.toml", "gpt_oss": "gpt_oss_debug.toml"}


@pytest.mark.parametrize("family", list(MOE_CONFIGS))
def test_the_default_balancing_is_one_the_release_format_holds(family):
    plan = preflight(debug_config(config=str(REPO / "train_configs" / MOE_CONFIGS[family])), 1)
    assert not get_model_spec(family).model.release_holds_routing_bias
    assert plan.model_args.load_balance_coeff == 0.0 and not plan.model_args.moe_args().load_balance_bias
    on = preflight(debug_config("--moe.load_balance_coeff=0.001",
                                config=str(REPO / "train_configs" / MOE_CONFIGS[family])), 1)
    assert on.model_args.moe_args().load_balance_bias  # asked for: still there


@pytest.mark.parametrize("family, flavor", [("qwen3", "debugmodel_moe"), ("mixtral", "debugmodel"),
                                            ("gpt_oss", "debugmodel")])
def test_a_trained_routing_bias_is_named_for_every_family_without_a_place_for_it(family, flavor):
    import dataclasses

    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors[flavor], load_balance_coeff=1e-3)
    with torch.device("meta"):
        names = [k for k in spec.build(args).state_dict() if k.endswith("router.expert_bias")]
    state = {name: torch.zeros(args.num_experts) for name in names}
    assert routing_bias_problem(state, args) is None  # never moved: the export is the model
    state[names[-1]][3] = 1e-3
    assert "--drop_routing_bias" in routing_bias_problem(state, args)


@pytest.mark.slow
def test_export_script_refuses_a_qwen3_moe_trained_with_the_bias_in_one_line(tmp_path, capsys):
    """train.py (one process, 2 steps, the bias on), then scripts/export_checkpoint.py --format hf: exit 2 with
    one line naming the option; with it, the folder is written and transformers reads it."""
    import subprocess
    import sys

    import transformers

    dump = tmp_path / "dump"
    env = torchrun_env()  # no RANK, MASTER_PORT...: a plain one-process run makes its own store
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--job.config_file",
                          str(REPO / "train_configs" / "qwen3_debug_moe.toml"), f"--job.dump_folder={dump}",
                          "--training.steps=2", "--training.seq_len=32", "--moe.load_balance_coeff=0.001",
                          "--metrics.enable_tensorboard=false", "--checkpoint.enable_checkpoint",
                          "--checkpoint.interval=2", "--checkpoint.model_weights_only"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    export = load_script("scripts/export_checkpoint.py").main
    checkpoint = str(dump / "checkpoint" / "step-2")
    capsys.readouterr()
    assert export([checkpoint, str(tmp_path / "refused"), "--format", "hf"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "routing bias" in line and "--drop_routing_bias" in line and "qwen3" in line, line
    assert not (tmp_path / "refused").exists()
    assert export([checkpoint, str(tmp_path / "dropped"), "--format", "hf", "--drop_routing_bias"]) == 0
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "dropped", dtype=torch.float32)
    assert model.config.num_experts == 8
