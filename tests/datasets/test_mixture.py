"""Weighted mixtures: the interleave's exact shares, the mixture's stream, resume, phases, and its config."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from torchtitan.config import ConfigManager, to_toml
from torchtitan.config.manager import ConfigError
from torchtitan.datasets import DataLayout, build_dataloader, build_tokenizer
from torchtitan.datasets.interleave import Interleave, integer_weights
from torchtitan.datasets.prepare import prepare_store
from torchtitan.datasets.token_store import TokenStore
from torchtitan.metrics.logger import format_step_line
from torchtitan.preflight import check_config

SEQ = 16


# ---------------------------------------------------------------- the interleave


def _worst_lag(weights: list[int], slots: int) -> float:
    inter = Interleave(weights)
    counts = [0] * len(weights)
    worst = 0.0
    for _ in range(slots):
        inter.take(counts, 1)
        worst = max(worst, max(abs(lag) for lag in inter.lags(counts)))
    return worst


def test_every_source_stays_within_one_sample_of_its_share_at_every_slot():
    rng = random.Random(0)
    for _ in range(300):
        weights = [rng.choice([1, 2, 3, 7, 100, 1000, rng.randint(1, 10_000)]) for _ in range(rng.randint(1, 10))]
        assert _worst_lag(weights, 300) < 1.0, weights
    # A case where "largest deficit first" (smooth weighted round-robin) drifts past one sample.
    weights = [5, 1000, 1000, 10, 5, 100, 5, 100]
    assert _worst_lag(weights, 400) < 1.0
    assert _swrr_worst_lag(weights, 400) > 1.0


def _swrr_worst_lag(weights: list[int], slots: int) -> float:
    total, counts, worst = sum(weights), [0] * len(weights), 0.0
    for n in range(1, slots + 1):
        i = max(range(len(weights)), key=lambda k: (n * weights[k] - counts[k] * total, -k))
        counts[i] += 1
        worst = max(worst, max(abs(n * w - c * total) / total for w, c in zip(weights, counts)))
    return worst


def test_float_weights_are_read_exactly_and_the_pattern_repeats():
    assert integer_weights([0.7, 0.3]) == (7, 3)
    assert integer_weights([2, 1.5, 0.25]) == (8, 6, 1)
    inter = Interleave([0.7, 0.2, 0.1])
    counts = [0, 0, 0]
    inter.take(counts, 10)
    assert counts == [7, 2, 1]  # whole periods are exact
    for bad in ([], [0.5, 0.0], [1.0, float("nan")], [-1.0]):
        with pytest.raises(ValueError):
            integer_weights(bad)


def test_the_order_is_pure_and_a_resume_at_any_slot_equals_the_uninterrupted_run():
    weights = [0.5, 0.3, 0.15, 0.05]
    whole = Interleave(weights).take([0, 0, 0, 0], 500)
    assert whole == Interleave(list(weights)).take([0, 0, 0, 0], 500)  # a function of the weights alone
    inter = Interleave(weights)
    for cut in (0, 1, 7, 19, 20, 21, 133, 499):
        counts = inter.counts_at(cut)  # the saved state, computed without replaying the run
        replay = [0, 0, 0, 0]
        inter.take(replay, cut)
        assert counts == replay
        assert inter.take(counts, 500 - cut) == whole[cut:]
    assert inter.counts_at(10**12 + 3)[0] == 5 * 10**11 + inter.counts_at(3)[0]  # O(1) however far



@pytest.mark.parametrize("weights", [[0.5, 0.3, 0.15, 0.05], [0.123457, 0.876543]])  # a table; a long period walked
def test_any_ranks_own_slots_are_those_of_the_whole_sequence(weights):
    whole = Interleave(weights).take([0] * len(weights), 700)
    inter = Interleave(weights)
    assert (inter.period <= 1 << 16) == (len(weights) == 4)
    for start, n in ((0, 5), (3, 64), (250, 17), (640, 60)):
        assert inter.slots(start, n) == whole[start:start + n]
        counts = [0] * len(weights)
        Interleave(weights).take(counts, start + n)
        assert inter.counts_at(start + n) == counts


# ---------------------------------------------------------------- the stream


def _store(tmp: Path, tokenizer_path: str, name: str, words: list[str], n_docs: int) -> Path:
    docs = [" ".join(words[(i * 5 + j) % len(words)] for j in range(4 + i % 9)) + f" {name} {i}."
            for i in range(n_docs)]
    return prepare_store(documents=docs, out_dir=tmp / name, tokenizer_path=tokenizer_path,
                         source={"label": name, "files": [], "fingerprint": name}, workers=1, progress=False)


@pytest.fixture(scope="module")
def stores(tmp_path_factory, shipped_tokenizer) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("mix")
    return {
        "web": _store(tmp, shipped_tokenizer, "web", "alpha beta gamma delta epsilon zeta eta theta".split(), 200),
        "code": _store(tmp, shipped_tokenizer, "code", "def return class import lambda yield".split(), 40),
        "math": _store(tmp, shipped_tokenizer, "math", "sum integral prime limit".split(), 15),
    }


@pytest.fixture(scope="module")
def tokenizer(shipped_tokenizer):
    return build_tokenizer(shipped_tokenizer)


MIX = [("web", 0.6), ("code", 0.3), ("math", 0.1)]


def mix_loader(stores, tokenizer, *, mix=MIX, batch=4, rank=0, degree=1, **kw):
    entries = [{"path": str(stores[name]), "weight": w} for name, w in mix]
    return build_dataloader(dataset_name="ignored", dataset_path=None, tokenizer=tokenizer,
                            layout=DataLayout(SEQ, batch, rank, degree), mix=entries, **kw)


def take(dl, n):
    it = iter(dl)
    return [next(it)[0] for _ in range(n)]


def global_batches(stores, tokenizer, degree, steps, batch, **kw):
    per_rank = [take(mix_loader(stores, tokenizer, batch=batch, rank=r, degree=degree, **kw), steps)
                for r in range(degree)]
    return [torch.cat([per_rank[r][s] for r in range(degree)]) for s in range(steps)]


def test_each_row_is_the_window_the_interleave_names_and_sources_start_new_epochs(stores, tokenizer, caplog):
    windows = {name: TokenStore(stores[name]) for name, _ in MIX}
    n = {name: s.n_tokens // (SEQ + 1) for name, s in windows.items()}
    steps = (2 * n["math"] * 10) // 4 + 1  # math (weight 0.1) runs out twice
    with caplog.at_level(logging.INFO, logger="torchtitan.datasets.mixture"):
        rows = torch.cat(take(mix_loader(stores, tokenizer, shuffle=False), steps))
    slots = Interleave([w for _, w in MIX]).take([0, 0, 0], rows.shape[0])
    for row, (i, c) in zip(rows, slots):
        name = MIX[i][0]
        expected = windows[name].read((c % n[name]) * (SEQ + 1), SEQ + 1)[:-1].astype(np.int64)
        assert torch.equal(row, torch.from_numpy(expected))
    assert "source math ran out after" in caplog.text and "starting its epoch 2 (seeded)" in caplog.text


def test_every_dp_layout_sees_the_same_global_batches_and_resumes_anywhere(stores, tokenizer):
    reference = global_batches(stores, tokenizer, 1, 12, 4)
    assert all(torch.equal(a, b) for a, b in zip(reference, global_batches(stores, tokenizer, 2, 12, 2)))
    dl = mix_loader(stores, tokenizer, batch=2, rank=1, degree=2)
    take(dl, 5)
    state = dl.state_dict()
    assert sum(int(v) for v in state["dataset_state"]["taken"].values()) == 20  # prefetch did not move it
    resumed = mix_loader(stores, tokenizer, batch=1, rank=0, degree=4)  # another layout, same global batch
    resumed.load_state_dict(state)
    assert torch.equal(take(resumed, 1)[0], reference[5][:1])
    one = mix_loader(stores, tokenizer, batch=4)
    one.load_state_dict(state)
    assert all(torch.equal(x, reference[5 + s]) for s, x in enumerate(take(one, 7)))


def test_tokens_per_source_are_the_interleaves_counts_and_reach_the_step_line(stores, tokenizer):
    dl = mix_loader(stores, tokenizer)
    take(dl, 5)
    counts = Interleave([0.6, 0.3, 0.1]).counts_at(20)
    assert dl.dataset.tokens_by_source() == {name: c * SEQ for (name, _), c in zip(MIX, counts)}
    line = format_step_line(5, {"loss": 1.0, **{f"data/tokens/{k}": float(v)
                                                 for k, v in dl.dataset.tokens_by_source().items()}})
    assert line.endswith("  mix: web 192 code 96 math 32"), line


def test_a_changed_mixture_is_refused_unless_a_new_phase_is_asked_for(stores, tokenizer):
    dl = mix_loader(stores, tokenizer)
    take(dl, 3)
    state = dl.state_dict()
    anneal = [("web", 0.2), ("math", 0.8)]
    refused = mix_loader(stores, tokenizer, mix=anneal)
    refused.load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_mix_new_phase") as e:
        iter(refused)
    assert "\n" not in str(e.value) and "web:0.6, code:0.3, math:0.1" in str(e.value)
    phases = []
    for _ in range(2):
        new = mix_loader(stores, tokenizer, mix=anneal, new_phase=True)
        new.load_state_dict(state)
        phases.append(take(new, 4))
        assert new.dataset.tokens_by_source()["web"] == state["dataset_state"]["tokens"]["0"] + 3 * SEQ
    assert all(torch.equal(a, b) for a, b in zip(*phases))  # a pure function of its inputs and the start
    # Resuming inside the new phase continues it (the option may stay set).
    cont = mix_loader(stores, tokenizer, mix=anneal, new_phase=True)
    mid = mix_loader(stores, tokenizer, mix=anneal, new_phase=True)
    mid.load_state_dict(state)
    take(mid, 2)
    cont.load_state_dict(mid.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(take(cont, 2), phases[0][2:]))
    # Another start gives another order of the same mixture.
    other = mix_loader(stores, tokenizer, mix=anneal, new_phase=True)
    take(dl, 1)
    other.load_state_dict(dl.state_dict())
    assert not torch.equal(take(other, 1)[0], phases[0][0])


def test_single_dataset_checkpoints_and_mixtures_do_not_mix_silently(stores, tokenizer):
    single = build_dataloader(dataset_name="x", dataset_path=str(stores["web"]), tokenizer=tokenizer,
                              layout=DataLayout(SEQ, 4, 0, 1))
    take(single, 2)
    mix = mix_loader(stores, tokenizer)
    mix.load_state_dict(single.state_dict())
    with pytest.raises(ValueError, match="checkpoint read a single dataset.*dataset_mix_new_phase"):
        iter(mix)
    started = mix_loader(stores, tokenizer, new_phase=True)
    started.dataset.load_state_dict(single.state_dict()["dataset_state"])  # as the checkpointer loads it
    started.dataset.start_at(8)
    assert len(take(started, 1)) == 1
    back = build_dataloader(dataset_name="x", dataset_path=str(stores["web"]), tokenizer=tokenizer,
                            layout=DataLayout(SEQ, 4, 0, 1))
    back.load_state_dict(started.state_dict())
    with pytest.raises(ValueError, match="mixture"):
        iter(back)


# ---------------------------------------------------------------- config


def test_toml_tables_and_the_cli_form_parse_to_the_same_mixture(tmp_path):
    toml = tmp_path / "mix.toml"
    toml.write_text('[[training.dataset_mix]]\npath = "/data/web"\nweight = 0.7\n'
                    '[[training.dataset_mix]]\ndataset = "embedded"\nweight = 0.3\nname = "docs"\n')
    manager = ConfigManager()
    from_toml = manager.parse_args(["--job.config_file", str(toml)]).training.dataset_mix
    assert from_toml == [{"path": "/data/web", "weight": 0.7}, {"dataset": "embedded", "weight": 0.3, "name": "docs"}]
    cli = manager.parse_args(["--training.dataset_mix", "0.7:/data/web,0.3:dataset=embedded"])
    assert cli.training.dataset_mix == [{"path": "/data/web", "weight": 0.7}, {"dataset": "embedded", "weight": 0.3}]
    written = tmp_path / "written.toml"
    written.write_text(to_toml(cli))
    assert manager.parse_args(["--job.config_file", str(written)]).training.dataset_mix == cli.training.dataset_mix
    # The CLI replaces the file's list.
    both = manager.parse_args(["--job.config_file", str(toml), "--training.dataset_mix", "1:path=/x"])
    assert both.training.dataset_mix == [{"path": "/x", "weight": 1.0}]


@pytest.mark.parametrize("value, message", [
    ("0.7", "is not WEIGHT:SOURCE"),
    ("x:/a", "'x' is not a weight"),
    ("0:/a", "weight 0.0: give a positive finite number"),
    ("nan:/a", "give a positive finite number"),
    ("0.5:dataset=", "exactly one of path or dataset"),
])
def test_bad_cli_items_are_one_line_each(value, message):
    with pytest.raises(ConfigError) as e:
        ConfigManager().parse_args(["--training.dataset_mix", value])
    assert len(e.value.problems) == 1 and message in e.value.problems[0]
    assert e.value.problems[0].startswith("--training.dataset_mix: ")


@pytest.mark.parametrize("table, message", [
    ('path = "/a"', "has no weight"),
    ('path = "/a"\ndataset = "embedded"\nweight = 1', "exactly one of path or dataset"),
    ('path = "/a"\nweight = 1\nwieght = 2', "unknown key(s) wieght"),
    ('path = "/a"\nweight = "heavy"', "is not a number"),
    ('path = 3\nweight = 1', "is not a string"),
])
def test_bad_toml_tables_are_one_line_each(tmp_path, table, message):
    toml = tmp_path / "bad.toml"
    toml.write_text(f"[[training.dataset_mix]]\n{table}\n")
    with pytest.raises(ConfigError) as e:
        ConfigManager().parse_args(["--job.config_file", str(toml)])
    assert len(e.value.problems) == 1 and message in e.value.problems[0], e.value.problems


def test_preflight_names_a_mixture_with_a_dataset_path_and_a_missing_source(tmp_path, tokenizer):
    from torchtitan.datasets.loaders import check_training_data

    cfg = ConfigManager().parse_args(["--training.dataset_mix", "1:/a", "--training.dataset_path", "/b"])
    assert any("--training.dataset_mix both name the training data" in p for p in check_config(cfg))
    missing = check_training_data(dataset_name="embedded", dataset_path=None, tokenizer=tokenizer, split=None,
                                  seq_len=SEQ, global_batch=4, mix=[{"path": str(tmp_path / "nope"), "weight": 1.0}])
    assert len(missing) == 1 and "not exist" in missing[0]
    assert missing[0].startswith("--training.dataset_mix source nope")
    twins = check_training_data(dataset_name="embedded", dataset_path=None, tokenizer=tokenizer, split=None,
                                seq_len=SEQ, global_batch=4, mix=[{"path": "/a/web", "weight": 1.0},
                                                                  {"path": "/b/web", "weight": 1.0}])
    assert twins and "share a name" in twins[0] and "name =" in twins[0]


def test_prepare_data_prepares_each_source_of_a_mixture_and_prints_the_tables(tmp_path, capsys, shipped_tokenizer):
    from conftest import load_script

    for name in ("web", "code"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name} document {i}."}) + "\n"
                                                        for i in range(60)))
    config = tmp_path / "train.toml"
    config.write_text(f"[validation]\nheld_out_fraction = 0.2\n"
                      f"[[training.dataset_mix]]\npath = \"{tmp_path}/web.jsonl\"\nweight = 3\n"
                      f"[[training.dataset_mix]]\npath = \"{tmp_path}/code.jsonl\"\nweight = 1\n")
    load_script("scripts/prepare_data.py").main(["--mix", str(config), str(tmp_path / "stores"), "--workers", "1",
                                                 "--no-progress", "--tokenizer", shipped_tokenizer])
    tables = tomllib.loads(capsys.readouterr().out)["training"]["dataset_mix"]
    assert [(t["path"], t["weight"]) for t in tables] == [(str(tmp_path / "stores" / "web"), 3.0),
                                                          (str(tmp_path / "stores" / "code"), 1.0)]
    for table in tables:
        store, held = TokenStore(table["path"]), TokenStore(table["validation_path"])
        assert store.split_key.side == "training" and held.split_key.side == "held_out"
        assert store.n_tokens > held.n_tokens > 0


def test_validation_parts_are_each_sources_held_out_documents_or_its_validation_path(tmp_path, stores, tokenizer):
    from torchtitan.datasets import HeldOutSplit
    from torchtitan.datasets.loaders import build_mixture_validation

    local = tmp_path / "notes.jsonl"
    local.write_text("".join(json.dumps({"text": f"note number {i} says hello."}) + "\n" for i in range(400)))
    mix = [{"path": str(local), "weight": 1.0},
           {"path": str(stores["web"]), "weight": 1.0, "validation_path": str(stores["code"])},
           {"path": str(stores["math"]), "weight": 1.0}]  # a prepared store without a held-out part
    split = HeldOutSplit(0.25, 0)
    parts = build_mixture_validation(mix, split=split, tokenizer=tokenizer,
                                     layout=DataLayout(SEQ, 1, 0, 1), cache_dir=str(tmp_path / "cache"))
    assert list(parts) == ["notes", "web"]
    assert parts["notes"].store.split_key == split.key("held_out")
    assert parts["web"].store.path == TokenStore(stores["code"]).path


def _hub_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A local folder that ``datasets.load_dataset`` reads as it reads a hub repository, and the same
    documents as one local file."""
    docs = "".join(json.dumps({"text": f"hub document {i} reads " + "word " * (i % 7)}) + "\n" for i in range(25))
    (tmp_path / "hubrepo").mkdir()
    (tmp_path / "hubrepo" / "train.jsonl").write_text(docs)
    (tmp_path / "local.jsonl").write_text(docs)
    return tmp_path / "hubrepo", tmp_path / "local.jsonl"


def test_a_hub_source_is_prepared_into_a_cached_store_once_and_reads_as_its_local_files(
        tmp_path, stores, tokenizer, monkeypatch):
    from torchtitan.datasets.loaders import open_mixture_sources
    from torchtitan.datasets.sources import HubDataset

    hub_dir, local = _hub_folder(tmp_path)
    cache = str(tmp_path / "cache")
    web = {"path": str(stores["web"]), "weight": 0.5}
    hub_mix = [{"dataset": f"hub:{hub_dir}", "weight": 1.5}, web]
    local_mix = [{"path": str(local), "weight": 1.5}, web]

    def batches(mix, degree):
        per_rank = [take(build_dataloader(dataset_name="ignored", dataset_path=None, tokenizer=tokenizer,
                                          layout=DataLayout(SEQ, 4 // degree, r, degree), mix=mix,
                                          cache_dir=cache), 12)
                    for r in range(degree)]
        return [torch.cat([per_rank[r][s] for r in range(degree)]) for s in range(12)]

    from_hub = batches(hub_mix, 2)
    hub_store = open_mixture_sources(hub_mix, tokenizer=tokenizer, split=None, cache_dir=cache)[0].store
    assert hub_store.path.parent == Path(cache) / "token_stores" and hub_store.path.name.startswith("hubrepo-")
    assert hub_store.index["source"]["fingerprint"] == HubDataset(str(hub_dir)).fingerprint
    assert hub_store.n_tokens // (SEQ + 1) < 12 * 4 * 0.75  # the hub source starts a second epoch in this test
    # The same windows as the same documents given as a local file, in every DP layout.
    from_local = batches(local_mix, 1)
    assert all(torch.equal(h, lo) for h, lo in zip(from_hub, from_local, strict=True))

    def no_hub(self):
        raise AssertionError("the hub was read again: the cached store should be reused")

    monkeypatch.setattr(HubDataset, "load", no_hub)
    again = batches(hub_mix, 1)
    assert all(torch.equal(a, h) for a, h in zip(again, from_hub, strict=True))


def test_a_hub_source_is_the_store_prepare_data_makes_and_has_a_held_out_part(tmp_path, tokenizer, shipped_tokenizer):
    from conftest import load_script

    from torchtitan.datasets import HeldOutSplit
    from torchtitan.datasets.loaders import build_mixture_validation, open_mixture_sources

    hub_dir, _ = _hub_folder(tmp_path)
    mix = [{"dataset": f"hub:{hub_dir}", "weight": 1.0}]
    cached = open_mixture_sources(mix, tokenizer=tokenizer, split=None, cache_dir=str(tmp_path / "cache"))[0].store
    out = load_script("scripts/prepare_data.py").main([f"hub:{hub_dir}", str(tmp_path / "made"), "--workers", "1",
                                                       "--no-progress", "--tokenizer", shipped_tokenizer])
    made = TokenStore(out)
    assert made.n_tokens == cached.n_tokens and np.array_equal(made.read(0, made.n_tokens),
                                                               cached.read(0, cached.n_tokens))
    split = HeldOutSplit(0.25, 0)
    parts = build_mixture_validation(mix, split=split, tokenizer=tokenizer,
                                     layout=DataLayout(SEQ, 1, 0, 1), cache_dir=str(tmp_path / "cache"))
    assert list(parts) == ["hubrepo"] and parts["hubrepo"].store.split_key == split.key("held_out")


def test_hub_sources_parse_from_toml_and_the_cli_and_are_named_by_their_repository(tmp_path):
    from torchtitan.config.dataset_mix import mix_source_name

    cli = ConfigManager().parse_args(["--training.dataset_mix", "0.7:hub:allenai/c4:en,0.3:dataset=c4"])
    assert cli.training.dataset_mix == [{"dataset": "hub:allenai/c4:en", "weight": 0.7},
                                        {"dataset": "c4", "weight": 0.3}]
    assert [mix_source_name(e) for e in cli.training.dataset_mix] == ["c4", "c4"]
    toml = tmp_path / "mix.toml"
    toml.write_text('[[training.dataset_mix]]\ndataset = "hub:allenai/c4:en"\nweight = 0.7\n')
    assert ConfigManager().parse_args(["--job.config_file", str(toml)]).training.dataset_mix == [
        {"dataset": "hub:allenai/c4:en", "weight": 0.7}]


def test_a_hub_source_without_a_name_is_one_line(tokenizer):
    from torchtitan.datasets.loaders import check_training_data

    problems = check_training_data(dataset_name="embedded", dataset_path=None, tokenizer=tokenizer, split=None,
                                   seq_len=SEQ, global_batch=4, mix=[{"dataset": "hub:", "weight": 1.0}])
    assert len(problems) == 1 and "names no hub dataset" in problems[0], problems


def test_one_index_of_a_window_order_is_the_arrays_entry():
    from torchtitan.datasets.window_order import WindowPermutation

    order = WindowPermutation(1000, 3, 1)
    assert [order.at(i) for i in range(1000)] == order(np.arange(1000)).tolist()
