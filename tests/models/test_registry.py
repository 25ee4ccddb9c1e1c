"""The model registry: families by ``--model.name``, and the seam that keeps them, and the components they
share (``models/common``, ``models/moe``), behind their ``ModelSpec``."""

from __future__ import annotations

import ast
import dataclasses
import pickle
import typing
from pathlib import Path

import pytest
import torch

from torchtitan.models import get_model_spec, model_args, model_names, spec_for_args
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.llama3 import ModelArgs, llama3_flavors
from torchtitan.models.spec import ModelSpec

PACKAGE = Path(__file__).resolve().parents[2] / "torchtitan"
FAMILIES = PACKAGE / "models"


def test_unknown_name_names_the_option_and_the_families():
    with pytest.raises(ValueError) as info:
        get_model_spec("gpt")
    assert str(info.value) == ("--model.name=gpt: unknown model family; choose one of llama3, qwen3, mixtral, "
                               "deepseek_v3, gpt_oss")
    with pytest.raises(ValueError, match="--model.name=gpt: unknown model family"):
        model_args("gpt", "debugmodel")


def test_llama3_is_found_with_its_flavors_and_model():
    spec = get_model_spec("llama3")
    assert isinstance(spec, ModelSpec) and spec.name == "llama3" and "llama3" in model_names()
    assert spec.flavors is llama3_flavors and spec.args_type is ModelArgs and spec.model is Decoder
    assert spec_for_args(llama3_flavors["8B"]) is spec
    assert model_args("llama3", "8B") is llama3_flavors["8B"]
    with pytest.raises(TypeError, match="no registered model family"):
        spec_for_args(object())


# What DeepSeek-V3's and GPT-OSS's model classes override of the decoder's seam; the other families are the
# decoder itself.
SEAM = ("flops_per_token", "hidden_width", "check", "default_load_balance_coeff", "with_job_options", "apply_tp",
        "use_attention", "prune_stage", "split_moe_over_tp", "apply_ep", "expert_layers", "assume_routing",
        "mtp_objective", "supports_kv_cache", "release_holds_routing_bias")
OVERRIDES = {"deepseek_v3": {"flops_per_token", "check", "with_job_options", "apply_tp", "prune_stage", "mtp_objective",
                             "release_holds_routing_bias"},
             "gpt_oss": {"flops_per_token", "apply_tp"}}


def test_a_family_is_its_model_class_and_the_spec_is_small_and_typed():
    """The spec holds a family's data (at most 9 fields, each typed, none ``Any``); what it does is its model
    class's, a ``Decoder`` that overrides only where the family differs."""
    fields = dataclasses.fields(ModelSpec)
    hints = typing.get_type_hints(ModelSpec)
    assert len(fields) <= 9, [f.name for f in fields]
    assert all(f.name in hints and "Any" not in str(hints[f.name]) for f in fields), hints
    for name in model_names():
        model = get_model_spec(name).model
        assert issubclass(model, Decoder), name
        below_decoder = model.__mro__[:model.__mro__.index(Decoder)]  # the family's own classes
        assert {m for m in SEAM if any(m in vars(c) for c in below_decoder)} == OVERRIDES.get(name, set()), name


def test_no_function_under_models_takes_the_whole_job_config():
    """The model seam takes the sections it reads ([model], [moe], [parallelism]), not ``JobConfig``."""
    found = []
    for path in sorted(FAMILIES.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                found += [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}({arg.arg})"
                          for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]
                          if arg.annotation is not None and "JobConfig" in ast.unparse(arg.annotation)]
    assert not found, found


@pytest.mark.parametrize("name", model_names())
def test_every_spec_pickles_as_the_planner_sends_it_to_its_workers(name):
    """The planner's pool pickles each rank's LaunchPlan, the spec in it: a lambda field fails there."""
    spec = get_model_spec(name)
    again = pickle.loads(pickle.dumps(spec))
    assert again.name == name and again.model.hidden_width(model_args(name, "debugmodel")) > 0


@pytest.mark.parametrize("name, flavor", [("llama3", "debugmodel"), ("qwen3", "debugmodel"),
                                          ("qwen3", "debugmodel_moe"), ("mixtral", "debugmodel")])
def test_the_spec_hands_the_step_and_the_planner_every_moe_layer(name, flavor):
    """The trainer's balancing and the planner's assumed routing see the MoE layers only through the model."""
    spec, args = get_model_spec(name), model_args(name, flavor)
    with torch.device("meta"):
        model = spec.build(args)
    sparse = [m for m in model.modules() if type(m).__name__ == "MoE"]
    assert bool(sparse) == bool(args.num_experts), (name, flavor)
    layers = model.expert_layers()
    assert [id(m) for m in layers] == [id(m) for m in sparse]
    assert all(m.tokens_per_expert.shape == (args.num_experts,) for m in layers)
    assert model.assume_routing(1.0) == len(sparse)
    assert all(type(m.dispatcher).__name__.startswith("Assumed") for m in sparse)


def _family_imports(path: Path, root: Path) -> list[str]:
    """The ``torchtitan.models.<package>`` modules (a family's, or a shared component's) that ``path`` (under
    the package ``root``) imports, relative imports resolved."""
    package = ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1]).split(".")
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], base]).strip(".")
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [n for n in names if _is_family_module(n, root / "models")]
    return found


# Packages and modules under models/ that are interface, not a family or a shared component: the attention
# backends (the step names the run's in its log line), the decoder's argument protocol that ModelSpec's
# fields are typed by, and the decoder class that every family's model is (ModelSpec.model; spec.family_model
# narrows a model part to it).
INTERFACE = ("torchtitan.models.attention", "torchtitan.models.common.config", "torchtitan.models.common.decoder")


def _is_family_module(name: str, families: Path) -> bool:
    """A module in a package under models/: a family, or a component the families share (``common``, ``moe``:
    the trainer and the planner reach the MoE layers through ``Decoder.expert_layers`` and
    ``assume_routing``). The modules directly in models/ (``spec.py``, ``expert_balance.py``, ``layers.py``,
    the registry) and ``INTERFACE`` are the interface below the families, open to all."""
    parts = name.split(".")
    if any(name == i or name.startswith(i + ".") for i in INTERFACE):
        return False
    return len(parts) >= 3 and parts[:2] == ["torchtitan", "models"] and (families / parts[2]).is_dir()


def _offenders(root: Path) -> dict[str, list[str]]:
    """Modules of the package ``root`` outside ``models/<package>/`` that import a family or a shared component."""
    families, out = root / "models", {}
    for path in sorted(root.rglob("*.py")):
        if path.is_relative_to(families) and len(path.relative_to(families).parts) > 1:
            continue  # inside models/<package>/: a family may import itself and the shared components
        found = _family_imports(path, root)
        if found:
            out[str(path.relative_to(root.parent))] = found
    return out


def test_no_module_outside_a_family_imports_one():
    offenders = _offenders(PACKAGE)
    assert not offenders, ("these modules import a model family or a component under models/; ask the family's "
                           f"ModelSpec (torchtitan.models registry, models/spec.py): {offenders}")


def test_the_import_check_finds_every_spelling(tmp_path):
    # The check above must be able to fail: a copy of the layout with offenders in each spelling.
    root = tmp_path / "torchtitan"
    (root / "models" / "llama3").mkdir(parents=True)
    (root / "models" / "moe").mkdir()
    (root / "planning").mkdir()
    (root / "train_step").mkdir()
    (root / "models" / "llama3" / "spec.py").write_text("from torchtitan.models.llama3 import model\n"
                                                        "from . import args\n")
    (root / "models" / "registry.py").write_text("from .llama3 import spec\nfrom torchtitan.models import spec\n")
    (root / "planning" / "run.py").write_text("import torchtitan.models.llama3.model\n"
                                              "from torchtitan.models.llama3 import Decoder\n"
                                              "from torchtitan.models import get_model_spec\n")
    # The MoE component is shared by families, not open to the step and the planner (they ask the spec).
    (root / "models" / "moe" / "moe.py").write_text("from torchtitan.models.expert_balance import ExpertLayer\n")
    (root / "models" / "llama3" / "model.py").write_text("from torchtitan.models.moe import MoE\n")
    (root / "train_step" / "experts.py").write_text("from torchtitan.models.moe.balance import aux_loss\n"
                                                    "from torchtitan.models.expert_balance import imbalance\n")
    (root / "planning" / "moe.py").write_text("from ..models.moe import dispatch\n")
    assert _offenders(root) == {
        "torchtitan/models/registry.py": ["torchtitan.models.llama3", "torchtitan.models.llama3.spec"],
        "torchtitan/planning/moe.py": ["torchtitan.models.moe", "torchtitan.models.moe.dispatch"],
        "torchtitan/planning/run.py": ["torchtitan.models.llama3.model", "torchtitan.models.llama3",
                                       "torchtitan.models.llama3.Decoder"],
        "torchtitan/train_step/experts.py": ["torchtitan.models.moe.balance", "torchtitan.models.moe.balance.aux_loss"],
    }
