"""The checkpoint folder protocol and the multi-stage model view, on one process without a process group."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from torchtitan.checkpoint import model_view
from torchtitan.checkpoint.store import commit, purge, scan, step_dir, tmp_dir


def _fake_save(folder: Path, step: int, payload: bytes = b"x") -> None:
    tmp = tmp_dir(folder, step)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(payload)
    (tmp / ".metadata").write_bytes(b"m")


def test_commit_makes_a_checkpoint_visible_only_when_complete(tmp_path):
    _fake_save(tmp_path, 5, b"12345")
    listing = scan(tmp_path)
    assert listing.committed == {} and list(listing.partial) == [5]
    final = commit(tmp_path, 5, {"kind": "full", "states": ["model"]})
    assert final == step_dir(tmp_path, 5) and not tmp_dir(tmp_path, 5).exists()
    manifest = json.loads((final / "checkpoint.json").read_text())
    assert manifest["step"] == 5 and manifest["files"] == {".metadata": 1, "__0_0.distcp": 5}
    # Saving the same step again (a run resumed from an older step) replaces it whole.
    _fake_save(tmp_path, 5, b"abc")
    commit(tmp_path, 5, {"kind": "full", "states": ["model"]})
    assert (final / "__0_0.distcp").read_bytes() == b"abc"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]


def test_purge_keeps_newest_k_protected_and_newer_leftovers(tmp_path):
    for step in (1, 2, 3, 4):
        _fake_save(tmp_path, step)
        commit(tmp_path, step, {})
    _fake_save(tmp_path, 0)  # an interrupted save older than the newest checkpoint: removable
    _fake_save(tmp_path, 9)  # a newer one may be an async save still in progress: kept
    deleted = purge(tmp_path, keep_latest_k=1, protected={2})
    assert sorted(p.name for p in deleted) == ["step-0.tmp", "step-1", "step-3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-4", "step-9.tmp"]
    assert purge(tmp_path, keep_latest_k=0, protected=set()) == []  # 0 keeps everything


def test_purge_never_deletes_the_only_complete_checkpoint(tmp_path):
    _fake_save(tmp_path, 3)
    commit(tmp_path, 3, {})
    assert purge(tmp_path, keep_latest_k=1, protected=set()) == []
    assert scan(tmp_path).latest() == 3


def _tiny_model():
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.models.llama3 import ModelArgs

    torch.manual_seed(0)
    model = Decoder(ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16))
    model.init_weights()
    return model


def _split(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Two pipeline-style stages: pruned deep copies that keep the original FQNs."""
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    for i in ("2", "3"):
        del first.layers[i]
    for i in ("0", "1"):
        del second.layers[i]
    first.norm = first.output = None
    second.tok_embeddings = None
    return [first, second]


def test_model_view_merges_stages_under_original_fqns():
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from torchtitan.checkpoint.states import OPTIM_OPTIONS

    whole = _tiny_model()
    parts = _split(whole)
    view = model_view(parts)
    assert [n for n, _ in view.named_parameters()] == [n for n, _ in whole.named_parameters()]
    assert all(a is b for (_, a), (_, b) in zip(view.named_parameters(),
                                                (x for part in parts for x in part.named_parameters())))
    assert "2" not in parts[0].layers and "0" not in parts[1].layers  # the stages themselves are untouched

    # One optimizer over both stages, as the trainer builds it; take a step so it has state.
    params = [p for part in parts for p in part.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    model_sd = get_model_state_dict(view)
    optim_sd = get_optimizer_state_dict(view, optimizer, options=OPTIM_OPTIONS)
    names = {n for n, _ in whole.named_parameters()}
    assert set(model_sd) == names
    # Flattened: one key per parameter and state, so pipeline ranks never write the same key.
    assert {k for k in optim_sd if k.startswith("state.")} == {f"state.{n}.{s}" for n in names
                                                               for s in ("step", "exp_avg", "exp_avg_sq")}

    # Load both into a fresh pair of stages: every value comes back.
    fresh = _split(_tiny_model())
    fresh_view = model_view(fresh)
    fresh_optimizer = torch.optim.AdamW([p for part in fresh for p in part.parameters()], lr=1e-2)
    with torch.no_grad():
        for p in fresh_view.parameters():
            p.zero_()
    set_model_state_dict(fresh_view, model_sd)
    set_optimizer_state_dict(fresh_view, fresh_optimizer, optim_sd, options=OPTIM_OPTIONS)
    for (name, a), (_, b) in zip(view.named_parameters(), fresh_view.named_parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(optimizer.state[a]["exp_avg"], fresh_optimizer.state[b]["exp_avg"]), name


def test_purge_keeps_the_newest_full_checkpoint_behind_a_weights_only_export(tmp_path):
    for step, kind in [(2, "full"), (4, "full"), (6, "weights_only")]:
        _fake_save(tmp_path, step)
        commit(tmp_path, step, {"kind": kind})
    purge(tmp_path, keep_latest_k=1, protected={6})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-6"]


def test_a_checkpoint_with_another_expert_count_is_named_in_one_line(tmp_path):
    from torchtitan.checkpoint.store import shape_problems

    def moe(experts: int) -> dict[str, tuple[int, ...]]:
        shapes = {"layers.1.feed_forward.router.gate.weight": (experts, 16)}
        for w, shape in (("w1", (32, 16)), ("w2", (16, 32)), ("w3", (32, 16))):
            shapes[f"layers.1.feed_forward.experts.{w}"] = (experts, *shape)
        return shapes

    problems = shape_problems(tmp_path, moe(8), moe(4))
    assert problems[0] == (f"checkpoint {tmp_path} holds 8 experts per MoE layer, this model 4: resume it with the "
                           "flavor it was saved with (--model.flavor), or start a new run")
    # The router's [E, D] weight is still listed; the stacked experts are not listed again.
    assert len(problems) == 2 and "router.gate.weight" in problems[1] and "experts.w" not in problems[1]
    assert shape_problems(tmp_path, moe(8), moe(8)) == []
