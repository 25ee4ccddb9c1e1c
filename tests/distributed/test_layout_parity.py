"""Every layout trains the same model: init parity, replica/shard invariants, loss parity, reproducibility.

All runs use float32 on CPU/gloo, the debug model, ``training.deterministic`` and
the same global batch (8 sequences): local batch 1 on 8 ranks, 8 on one process.
They train 8 steps, hold 5% of the documents out of training and validate on them (two
global batches of 8) every 4 steps and at the last one: the validation loss must match
one process's too, and validating must leave training bitwise unchanged.
"""

from __future__ import annotations

import hashlib
import sys
import time

import conftest
import pytest
import torch
from conftest import DEBUG_CONFIG
from dist_harness import run_ranks
from torch.distributed.tensor import DTensor

pytestmark = pytest.mark.slow  # every test here starts processes

DEBUG = DEBUG_CONFIG
STEPS = 8

# name -> (ranks, overrides); local batch is 8 / dp degree so the global batch is always 8.
LAYOUTS = {
    "FSDP 8": (8, ["--parallelism.data_parallel_shard_degree=8", "--training.batch_size=1"]),
    "HSDP 2x4": (8, ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=4",
                     "--training.batch_size=1"]),
    "DDP 8": (8, ["--parallelism.data_parallel_replicate_degree=8", "--parallelism.data_parallel_shard_degree=1",
                  "--training.batch_size=1"]),
}
CONTROL = (1, ["--training.batch_size=8"])
HELD_OUT = "--validation.held_out_fraction=0.05"
# The validation batch defaults to the training one, so the global validation batch is 8 in every layout.
VALIDATION = [HELD_OUT, "--validation.enable", "--validation.freq=4", "--validation.steps=2"]


def make_trainer(dump: str, *overrides: str):
    return conftest.make_trainer(dump, "--metrics.log_freq=1000", "--training.deterministic",
                                 f"--training.steps={STEPS}", *overrides)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _init_and_train(rank: int, world_size: int, dump: str, overrides: list[str], train: bool,
                    tied: bool = True) -> dict:
    from torchtitan.distributed.layout_init import gather_full_state_dict

    trainer = make_trainer(dump, *VALIDATION, *overrides)
    full = gather_full_state_dict(trainer.model_parts[0])
    local = {}
    for fqn, param in trainer.model_parts[0].named_parameters():
        shard = param.to_local() if isinstance(param, DTensor) else param
        local[fqn] = _digest(shard)
    specs = {fqn: spec.kind for fqn, spec in trainer.model_parts[0].param_init_specs().items()}
    out = {"local": local, "kinds": specs}
    if rank == 0:
        out["full"] = {fqn: _digest(t) for fqn, t in full.items()}
    if train:
        out["losses"] = trainer.train()
        out["validation"] = trainer.validation_losses
        if tied:
            out["tied"] = _tied_run(rank, dump, overrides)
    return out


TIED_STEPS = 3


def _tied_run(rank: int, dump: str, overrides: list[str]) -> dict:
    """The tied flavor in the same world: one parameter for embedding and output, the same init and losses."""
    from torchtitan.distributed.layout_init import gather_full_state_dict

    trainer = make_trainer(f"{dump}/tied", *overrides, "--model.flavor=debugmodel_tied",
                           f"--training.steps={TIED_STEPS}")
    model = trainer.model_parts[0]
    tied = model.output.weight is model.tok_embeddings.weight
    full = gather_full_state_dict(model)
    out = {"tied": tied, "n_params": sum(p.numel() for p in model.parameters())}
    if rank == 0:
        out["full"] = {fqn: _digest(t) for fqn, t in full.items()}
    out["losses"] = trainer.train()
    return out


@pytest.fixture(scope="module")
def control(tmp_path_factory) -> dict:
    ranks, overrides = CONTROL
    (result,) = run_ranks(_init_and_train, ranks, str(tmp_path_factory.mktemp("control")), overrides, True)
    return result


def train_layouts(rank: int, world_size: int, root: str, layouts: dict[str, list[str]], steps: int | None = None,
                  tied: bool = True) -> dict:
    """Train each layout in turn in one process group: a world of that size is spawned once."""
    out = {}
    for i, (name, overrides) in enumerate(layouts.items()):
        start = time.monotonic()
        extra = [] if steps is None else [f"--training.steps={steps}"]
        out[name] = _init_and_train(rank, world_size, f"{root}/{i}", [*extra, *overrides], True, tied=tied)
        if rank == 0:  # shown with the failure if a later layout hangs and the harness times out
            print(f"[{world_size} ranks] {name}: {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    return out


def spawn_layouts(tmp_path_factory, layouts: dict[str, tuple[int, list[str]]], steps: int | None = None,
                  tied: bool = True) -> dict[str, list[dict]]:
    """Layout name -> every rank's result; one process group per world size trains its layouts in turn."""
    results: dict[str, list[dict]] = {}
    for world_size in sorted({ranks for ranks, _ in layouts.values()}):
        of_size = {name: overrides for name, (ranks, overrides) in layouts.items() if ranks == world_size}
        dump = str(tmp_path_factory.mktemp(f"world{world_size}"))
        per_rank = run_ranks(train_layouts, world_size, dump, of_size, steps, tied, timeout=3000,
                             collective_timeout=300)
        results.update({name: [r[name] for r in per_rank] for name in of_size})
    return results


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    return spawn_layouts(tmp_path_factory, LAYOUTS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_init_is_bitwise_the_single_process_init(name, layouts, control):
    assert layouts[name][0]["full"] == control["full"]


def test_uneven_shards_init_bitwise(tmp_path, control):
    # 3 ranks: dims of 256 or 2048 rows do not split evenly.
    results = run_ranks(_init_and_train, 3, str(tmp_path), ["--parallelism.data_parallel_shard_degree=3"], False)
    assert results[0]["full"] == control["full"]


def test_replicas_identical_shards_distinct(layouts):
    random_params = [fqn for fqn, kind in layouts["FSDP 8"][0]["kinds"].items() if kind not in ("ones", "zeros")]
    hsdp = layouts["HSDP 2x4"]
    for fqn in random_params:
        for shard in range(4):  # rank = replica * 4 + shard
            assert hsdp[shard]["local"][fqn] == hsdp[4 + shard]["local"][fqn], fqn
        assert len({hsdp[s]["local"][fqn] for s in range(4)}) == 4, fqn
        fsdp = layouts["FSDP 8"]
        assert len({fsdp[r]["local"][fqn] for r in range(8)}) == 8, fqn
        ddp = layouts["DDP 8"]
        assert len({ddp[r]["local"][fqn] for r in range(8)}) == 1, fqn
    # Different layers get different values by construction (the FQN is part of the seed).
    assert layouts["FSDP 8"][0]["full"]["layers.0.attention.wq.weight"] != \
        layouts["FSDP 8"][0]["full"]["layers.1.attention.wq.weight"]


def test_loss_parity_across_layouts(layouts, control):
    reference = control["losses"]
    print(f"\n{'layout':<10} {'step-1 loss':>12} {'step-1 rel':>11} {f'max rel ({STEPS} steps)':>20}")
    print(f"{'control':<10} {reference[0]:>12.7f} {0:>11.2e} {0:>20.2e}")
    for name, results in layouts.items():
        losses = results[0]["losses"]
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
        print(f"{name:<10} {losses[0]:>12.7f} {rel[0]:>11.2e} {max(rel):>20.2e}")
        assert all(r["losses"] == losses for r in results)  # the logged loss is global: same on all ranks
        assert rel[0] <= 1e-6, name
        assert max(rel) <= 1e-4, (name, max(rel))
        assert_validation_parity(name, results, control)
    assert reference[-1] < reference[0] - 0.3  # and the model does learn (8.05 to 7.56 in 8 steps)


def test_tied_flavor_trains_tied_and_alike_in_every_layout(layouts, control):
    reference = control["tied"]
    assert reference["tied"] and "output.weight" not in reference["full"]  # one parameter, named once
    untied = {k: v for k, v in control["full"].items() if k != "output.weight"}
    differ = [k for k in untied if untied[k] != reference["full"][k]]
    assert differ == ["tok_embeddings.weight"], differ  # only it changes: it takes the output's init rule
    for name, results in layouts.items():
        tied = results[0]["tied"]
        assert all(r["tied"]["tied"] for r in results), name  # one parameter after FSDP/HSDP/DDP
        assert tied["full"] == reference["full"], name
        assert all(r["tied"]["losses"] == tied["losses"] for r in results), name
        rel = [abs(a - b) / b for a, b in zip(tied["losses"], reference["losses"])]
        assert rel[0] <= 1e-6 and max(rel) <= 1e-5, (name, rel)


def assert_validation_parity(name: str, results: list[dict], control: dict) -> None:
    """Every rank reports the same validation losses, at the same steps, as one process (curve tolerance)."""
    validation, reference = results[0]["validation"], control["validation"]
    assert all(r["validation"] == validation for r in results), name
    assert sorted(validation) == sorted(reference) and reference, (name, validation, reference)
    rel = {step: abs(validation[step] - v) / v for step, v in reference.items()}
    print(f"{name}: validation loss {validation}, rel to control {max(rel.values()):.2e}")
    assert max(rel.values()) <= 1e-4, (name, rel)


def _training_state(trainer) -> dict:
    """Digests of everything validation must leave alone."""
    params = [p for part in trainer.model_parts for p in part.parameters()]
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    optim = [_digest(v.to_local() if isinstance(v, DTensor) else v) for p in params
             for v in trainer.optimizer.state[p].values() if isinstance(v, torch.Tensor)]
    return {"params": [_digest(t) for t in local], "grads": [p.grad is None for p in params], "optim": optim,
            "rng": _digest(torch.get_rng_state()), "data": trainer.dataloader.dataset.state_dict(),
            "train_mode": [part.training for part in trainer.model_parts]}


def _losses(rank: int, world_size: int, dump: str, overrides: list[str]) -> dict:
    trainer = make_trainer(dump, "--training.steps=6", HELD_OUT, *overrides)
    unchanged, validate = [], trainer.validate

    def watched_validate():
        before = _training_state(trainer)
        result = validate()
        unchanged.append(_training_state(trainer) == before)
        return result

    trainer.validate = watched_validate
    return {"losses": trainer.train(), "validation": trainer.validation_losses, "unchanged": unchanged}


def test_same_seed_same_layout_is_bitwise_reproducible_and_validation_does_not_disturb_training(tmp_path):
    fsdp2 = ["--parallelism.data_parallel_shard_degree=2"]
    first = run_ranks(_losses, 2, str(tmp_path / "a"), fsdp2)[0]
    # The same run validating at steps 2, 4 and 6 (the last).
    second = run_ranks(_losses, 2, str(tmp_path / "b"), [*fsdp2, "--validation.enable", "--validation.freq=2",
                                                         "--validation.steps=1"])[0]
    other_seed = run_ranks(_losses, 2, str(tmp_path / "c"), [*fsdp2, "--training.seed=7"])[0]
    assert first["losses"] == second["losses"]  # bitwise: exact float equality at every step
    assert first["validation"] == {} and sorted(second["validation"]) == [2, 4, 6]
    # Parameters, optimizer state, RNG, data position and train mode: the same after each validation as before.
    assert second["unchanged"] == [True, True, True]
    assert first["losses"][0] != other_seed["losses"][0]
