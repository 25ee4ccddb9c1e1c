"""Weights of other formats in and out: Hugging Face folders, Meta's release, checkpoints of this project.

In (``--checkpoint.initial_load_path`` / ``initial_load_format``):

- ``hf``: ``config.json`` + ``model.safetensors`` or ``model.safetensors.index.json`` and its shards;
- ``meta``: ``params.json`` + ``consolidated.*.pth`` (several files: model-parallel shards, joined here);
- ``dcp``: a committed ``step-N`` folder of this project, or a checkpoint folder (its latest step).

``check_source`` runs in preflight on every rank before any process group exists: it reads
only ``config.json``/``params.json``, file headers and sizes, and names every problem.
``load_into`` is the one way weights are read, by the trainer, generation, the export and the tests
(``load_model`` builds the whole model for those that need one). It fills a model of any layout: each
rank reads the region of every tensor it holds (safetensors slices; DCP's own sharded reads), so no rank
reads the whole model unless it holds it (Meta's pickled files are memory-mapped, so only the touched
pages are read). The state (parameters, and persistent buffers such as an MoE router's bias) is read;
the derived buffers (the rotary table) are rebuilt before the read, so nothing read is reset after it.
An FP8 release's float8 weights are dequantized with their block scales; float8 codes without their
scales are refused in one line (in preflight already).

Out: ``export_hf`` writes safetensors shards, their index, ``config.json``, ``generation_config.json``
and the tokenizer files (Meta's tiktoken file and a SentencePiece model also converted to
``tokenizer.json``, ``hf_tokenizer.py``).
The name and layout mapping itself is the model family's ``StateDictAdapter`` (its ``ModelSpec``,
``torchtitan/models/spec.py``), found from the model's args.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import struct
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint.state_dict_loader as dcp_loader
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.checkpoint.location import Location, RemotePath, location
from torchtitan.checkpoint.no_pickle import NoPickleLoadPlanner
from torchtitan.checkpoint.quantized import SCALE_SUFFIX, dequantize_fp8_blocks, fp8_block_size
from torchtitan.checkpoint.store import dcp_reader, read_dcp_metadata
from torchtitan.lfs import check_not_lfs_pointer
from torchtitan.models import DecoderConfig, spec_for_args
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.spec import HFConversion, MetaRelease, StateDictAdapter

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FLOAT8_DTYPES = ("F8_E4M3", "F8_E5M2")  # the safetensors names of float8 tensors (FP8 releases' weights)
_SAFETENSORS_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                       "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


# ---------------------------------------------------------------- reading the sources


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file; ValueError when it is missing, unreadable or truncated."""
    check_not_lfs_pointer(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is truncated ({size} bytes): not even a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            raise ValueError(f"{path} is truncated: its header needs {8 + n} bytes, the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is not a safetensors file (unreadable header: {e})") from None
    header.pop("__metadata__", None)
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + n + end > size:
        raise ValueError(f"{path} is truncated: its tensors need {8 + n + end} bytes, the file has {size}; "
                         "download it again")
    return header


class HFSource:
    """A Hugging Face folder: which file holds which tensor, with shapes from the headers.

    ``adapter`` (the model family's names and layouts) is needed to read tensors by our names.
    """

    def __init__(self, folder: Path, adapter: StateDictAdapter | None = None) -> None:
        self.folder, self.adapter = folder, adapter
        self.config = json.loads((folder / "config.json").read_text())
        # FP8 weights dequantized on read (checkpoint/quantized.py); the family's own methods by its adapter
        self.fp8_block = fp8_block_size(self.config, adapter.quant_methods if adapter is not None else ())
        index = folder / INDEX_FILE
        weight_map: dict[str, str] | None
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / SINGLE_FILE).is_file():
            weight_map = None
        else:
            raise ValueError(f"{folder} has neither {INDEX_FILE} nor {SINGLE_FILE}")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise ValueError(f"{index} names file(s) that are not there: {', '.join(missing)}; download them again")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.file_of: dict[str, str] = {}
        self.dtypes: dict[str, str] = {}  # as the headers spell them: F32, BF16, F8_E4M3, ...
        for name in files:
            for tensor, entry in safetensors_header(folder / name).items():
                self.shapes[tensor], self.file_of[tensor] = tuple(entry["shape"]), name
                self.dtypes[tensor] = entry["dtype"]
        if weight_map:
            absent = sorted(t for t, f in weight_map.items() if self.file_of.get(t) != f)
            if absent:
                raise ValueError(f"{index} places {len(absent)} tensor(s) in files that lack them, e.g. "
                                 f"{absent[0]} in {weight_map[absent[0]]}")

    def tensor_for(self, fqn: str) -> str:
        assert self.adapter is not None, "reading tensors needs the family's adapter"
        return self.adapter.hf_name(fqn, tied=bool(self.config.get("tie_word_embeddings")))

    def expert_names(self, fqn: str, args: DecoderConfig) -> list[str] | None:
        """The per-expert tensors of our stacked ``fqn`` (None: not stacked); ValueError naming one that is absent."""
        assert self.adapter is not None, "reading tensors needs the family's adapter"
        names = self.adapter.hf_expert_names(fqn, args)
        if names is not None:
            missing = [n for n in names if n not in self.shapes]
            if missing:
                raise ValueError(f"{self.folder} lacks the expert tensor {missing[0]} (for our {fqn}); the release "
                                 "is incomplete or has fewer experts than the configured model")
        return names

    def conversion(self, fqn: str, args: DecoderConfig) -> HFConversion | None:
        """The family's conversion of our ``fqn`` from this folder's tensors (None: renamed, stacked or permuted)."""
        assert self.adapter is not None, "reading tensors needs the family's adapter"
        return self.adapter.hf_conversion(fqn, args, self.shapes, lambda name: self._read_one(name, None))

    def shape_of(self, fqn: str, args: DecoderConfig) -> tuple[int, ...] | None:
        """Our ``fqn``'s shape as the folder holds it (stacked experts: [E, ...]); None: absent."""
        converted = self.conversion(fqn, args)
        if converted is not None:
            return converted.shape
        experts = self.expert_names(fqn, args)
        if experts is not None:
            return (len(experts), *self.shapes[experts[0]])
        return self.shapes.get(self.tensor_for(fqn))

    def float8_problem(self, name: str) -> str | None:
        """Why tensor ``name`` has no value to load: stored in float8 without the block scales that give it one
        (its codes alone are thousands of times too large); None: it has one."""
        dtype = self.dtypes.get(name)
        if dtype not in _FLOAT8_DTYPES:
            return None
        where = f"{self.folder / self.file_of[name]}: {name} is stored as {dtype}"
        if self.fp8_block is None:
            return (f"{where}, but {self.folder / 'config.json'} states no fp8 quantization_config to dequantize it "
                    "with; add the release's quantization_config, or dequantize the release first")
        if name + SCALE_SUFFIX not in self.shapes:
            return (f"{where} without its scale {name}{SCALE_SUFFIX} (in no file of {self.folder}); the release is "
                    "incomplete: download it again")
        return None

    def float8_problems(self, fqns: Iterable[str], args: DecoderConfig) -> list[str]:
        """One line for the tensors read for ``fqns`` that are float8 without their scales (the first, and how
        many more: a release without its scale files lacks thousands); empty when every one has a value."""
        found = [problem for fqn in fqns for name in self.stored_names(fqn, args)
                 if (problem := self.float8_problem(name)) is not None]
        if len(found) > 1:
            return [f"{found[0]} (and {len(found) - 1} more float8 tensor(s) like it)"]
        return found

    def stored_names(self, fqn: str, args: DecoderConfig) -> list[str]:
        """The folder's tensors read as they are stored for our ``fqn`` (none for a family's conversion, which
        dequantizes its own format)."""
        if self.conversion(fqn, args) is not None:
            return []
        experts = self.expert_names(fqn, args)
        if experts is not None:
            return experts
        name = self.tensor_for(fqn)
        return [name] if name in self.shapes else []

    def _read_one(self, name: str, region: tuple[tuple[int, int], ...] | None) -> torch.Tensor:
        """Tensor ``name`` (or its ``region``) as stored, an FP8 block-quantized weight as float32; ValueError
        (one line) for float8 codes without their scales."""
        problem = self.float8_problem(name)
        if problem is not None:
            raise ValueError(problem)
        if self.fp8_block is not None and name + SCALE_SUFFIX in self.shapes:
            whole = dequantize_fp8_blocks(self._read_plain(name, None), self._read_plain(name + SCALE_SUFFIX, None),
                                          self.fp8_block)
            return whole if region is None else whole[tuple(slice(a, b) for a, b in region)]
        return self._read_plain(name, region)

    def _read_plain(self, name: str, region: tuple[tuple[int, int], ...] | None) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.folder / self.file_of[name]), framework="pt") as f:
            view = f.get_slice(name)
            if region is None:
                return view[:]
            return view[tuple(slice(a, b) for a, b in region)]

    def read(self, fqn: str, args: DecoderConfig, region: tuple[tuple[int, int], ...] | None) -> torch.Tensor:
        """Our tensor ``fqn`` (our layout), or the ``region`` (start, stop per dim) of it; reads only that region.

        Where Hugging Face orders the rows of each head otherwise (e.g. rotary q/k), the rows of a region
        are spread over the heads it touches: read those whole heads (rows) and the region's columns,
        reorder, cut.
        """
        from safetensors import safe_open

        converted = self.conversion(fqn, args)
        if converted is not None:  # made from other tensors: convert all of it, cut the region
            return converted.read()[tuple(slice(a, b) for a, b in region or ())]
        experts = self.expert_names(fqn, args)
        if experts is not None:  # stacked here, one tensor per expert there: read the region's experts
            (e0, e1), rest = (region or ((0, len(experts)),))[0], (region or ())[1:]
            return torch.stack([self._read_one(experts[e], rest or None) for e in range(e0, e1)])
        name = self.tensor_for(fqn)
        assert self.adapter is not None, "reading tensors needs the family's adapter"
        shape = self.shapes[name]
        region = region or tuple((0, s) for s in shape)
        heads = self.adapter.hf_permuted_heads(fqn, args)
        if heads is not None and len(shape) == 1:  # a per-head vector (a query/key norm): small, read whole
            return self.adapter.rows_from_hf(fqn, self._read_one(name, None), heads)[region[0][0]:region[0][1]]
        if heads is None:
            return self._read_one(name, region)
        with safe_open(str(self.folder / self.file_of[name]), framework="pt") as f:
            view = f.get_slice(name)
            hd = shape[0] // heads
            (r0, r1), (c0, c1) = region
            h0, h1 = r0 // hd, math.ceil(r1 / hd)
            block = view[h0 * hd:h1 * hd, c0:c1]
            return self.adapter.rows_from_hf(fqn, block, h1 - h0)[r0 - h0 * hd:r1 - h0 * hd]


class MetaSource:
    """Meta's release folder: params.json and one or more consolidated.NN.pth (model-parallel shards)."""

    def __init__(self, folder: Path, release: MetaRelease | None = None) -> None:
        self.folder, self.release = folder, release
        self.params = json.loads((folder / "params.json").read_text())
        self.files = sorted(folder.glob("consolidated.*.pth"))
        if not self.files:
            raise ValueError(f"{folder} holds no consolidated.*.pth")
        for file in self.files:
            check_not_lfs_pointer(file)
        self._parts: list[dict[str, torch.Tensor]] | None = None

    def parts(self) -> list[dict[str, torch.Tensor]]:
        if self._parts is None:
            try:
                self._parts = [torch.load(f, map_location="cpu", mmap=True, weights_only=True) for f in self.files]
            except Exception as e:  # noqa: BLE001 - a truncated zip, a bad pickle: the same problem
                raise ValueError(f"{self.folder}: a consolidated.*.pth is unreadable ({type(e).__name__}: {e}); "
                                 "download it again") from None
        return self._parts

    def shapes(self) -> dict[str, tuple[int, ...]]:
        assert self.release is not None, "reading tensors needs the family's Meta reader"
        out = {}
        for fqn, t in self.parts()[0].items():
            shape = list(t.shape)
            dim = self.release.split_dim(fqn)
            if dim is not None and len(self.parts()) > 1:
                shape[dim] = sum(p[fqn].shape[dim] for p in self.parts())
            out[fqn] = tuple(shape)
        return out

    def read(self, fqn: str, args: DecoderConfig, region: tuple[tuple[int, int], ...] | None) -> torch.Tensor:
        assert self.release is not None, "reading tensors needs the family's Meta reader"
        fqn = self.release.name(fqn, args, self.parts()[0])
        pieces = [p[fqn] for p in self.parts()]
        dim = self.release.split_dim(fqn)
        full = pieces[0] if len(pieces) == 1 or dim is None else torch.cat(pieces, dim=dim)
        if region is None:
            return full.clone()
        return full[tuple(slice(a, b) for a, b in region)].clone()


def find_run_config(checkpoint: Path) -> Path | None:
    """The ``config.toml`` the trainer wrote into the dump folder: ``<dump>/<folder>/step-N`` -> ``<dump>``."""
    for parent in list(checkpoint.resolve().parents)[:3]:
        if (parent / "config.toml").is_file():
            return parent / "config.toml"
    return None


def dcp_checkpoint_path(path: Location) -> Location:
    """A committed step folder as given, or the latest one of a checkpoint folder."""
    from torchtitan.checkpoint.store import scan

    if (path / ".metadata").is_file():
        return path
    latest = scan(path).latest()
    if latest is None:
        raise ValueError(f"{path} is neither a checkpoint (no .metadata) nor a folder of committed step-N "
                         "checkpoints")
    return scan(path).committed[latest]


def expected_shapes(args: DecoderConfig, buffers: bool = False) -> dict[str, tuple[int, ...]]:
    """FQN -> shape of the model's parameters (a release's tensors), with ``buffers`` its persistent buffers
    too (a checkpoint's: an MoE router's bias)."""
    with torch.device("meta"):
        model = spec_for_args(args).build(args)
    if buffers:
        return {fqn: tuple(t.shape) for fqn, t in model.state_dict(keep_vars=True).items()}
    # Every name a state dict holds: a tied weight is loaded under both of its names.
    return {fqn: tuple(p.shape) for fqn, p in model.named_parameters(remove_duplicate=False)}


def check_source(path: str, fmt: str, args: DecoderConfig) -> list[str]:
    """Problems with ``--checkpoint.initial_load_path`` for the configured model; reads headers only."""
    from torchtitan.checkpoint.store import shape_problems, verify

    where = location(path)
    flag = f"--checkpoint.initial_load_path={path}"
    if isinstance(where, RemotePath) and fmt != "dcp":
        return [f"{flag}: {fmt} weights are read from a local folder only; download them first (an object-store "
                "URI takes --checkpoint.initial_load_format=dcp, a checkpoint of this project)"]
    if not where.is_dir():
        return [f"{flag}: no such folder"]
    expected = expected_shapes(args)
    spec = spec_for_args(args)
    adapter = spec.state_dict_adapter
    try:
        if fmt == "hf":
            if not (where / "config.json").is_file():
                return [f"{flag}: no config.json there; --checkpoint.initial_load_format=hf wants a Hugging Face "
                        "folder (config.json + *.safetensors)"]
            assert isinstance(where, Path)  # a remote source is dcp, above
            source = HFSource(where, adapter)
            problems = adapter.hf_config_problems(args, source.config, f"{flag}/config.json")
            if problems:
                return problems + ["choose the --model.flavor and --model.tokenizer_path that match these weights"]
            found = {}
            for fqn in expected:
                shape = source.shape_of(fqn, args)
                if shape is not None:
                    found[fqn] = shape
            # float8 codes without their scales: the shapes are right, the values thousands of times too large
            return shape_problems(where, found, expected) or [f"{flag}: {problem}" for problem in
                                                               source.float8_problems(expected, args)]
        if fmt == "meta":
            if not (where / "params.json").is_file():
                return [f"{flag}: no params.json there; --checkpoint.initial_load_format=meta wants Meta's release "
                        "folder (params.json + consolidated.*.pth)"]
            assert isinstance(where, Path)
            if spec.meta_release is None:
                return [f"{flag}/params.json: this model family has no Meta-format release; use "
                        "--checkpoint.initial_load_format=hf"]
            source = MetaSource(where, spec.meta_release)
            problems = spec.meta_release.params_problems(args, source.params, f"{flag}/params.json")
            if problems:
                return problems + ["choose the --model.flavor and --model.tokenizer_path that match these weights"]
            return shape_problems(where, spec.meta_release.shapes(source.shapes(), expected, args), expected)
        ckpt = dcp_checkpoint_path(where)
        problems, manifest = verify(ckpt, expected_shapes(args, buffers=True))
        if not problems and "model" not in manifest.get("states", []):
            problems.append(f"{flag}: checkpoint {ckpt} holds no model weights")
        return problems
    except KeyError as e:
        return [f"{flag}: {'config.json' if fmt == 'hf' else 'params.json'} lacks the entry {e}"]
    except (ValueError, OSError) as e:
        return [f"{flag}: {e}"]


# ---------------------------------------------------------------- loading into a model of any layout


def _region(value: torch.Tensor) -> tuple[tuple[int, int], ...] | None:
    """The (start, stop) per dim of the global tensor this rank holds; None: all of it or not expressible."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(value, DTensor):
        return None
    if not all(type(p) in (Shard, Replicate) for p in value.placements):
        return None
    from torchtitan.compat import local_shape_and_global_offset

    shape, offset = local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return tuple((o, o + s) for o, s in zip(offset, shape))


def _release_buffer(source: HFSource | MetaSource, fqn: str) -> str | None:
    """The Hugging Face tensor that holds our buffer ``fqn``, when the family names one and the folder has it."""
    if not isinstance(source, HFSource):
        return None
    try:
        name = source.tensor_for(fqn)
    except KeyError:
        return None
    return name if name in source.shapes else None


def load_into(model: torch.nn.Module, path: str, fmt: str, args: DecoderConfig, process_group=None) -> int:
    """Fill ``model``'s state from ``path``: every parameter and persistent buffer; returns the tensors loaded.

    The one way weights are read: the trainer's initial load (``checkpoint/loader.py``), generation, the
    export and the tests all come here (``load_model`` builds the whole model for those that need one).
    ``model`` is materialized (``to_empty``) in the layout and dtype it runs in, or is a pipeline rank's parts
    as one view (``stage_view.py``).

    Buffers: the derived ones (the rotary table, the expert counts) are rebuilt first by the model's
    ``init_buffers``, which also sets the state's buffers (an MoE router's bias) to their initial value;
    then the read fills the whole state, the routing bias included, and nothing re-initializes it after.
    A release that has no place for the bias leaves it at its initial value (zero: no bias). A pipeline
    view has no ``init_buffers``: its stages built their buffers when they were made.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if isinstance(model, Decoder):  # a pipeline view is none: its stages built their buffers
        model.init_buffers()  # before the read: the state it fills is never reset after
    # A model's state dict holds tensors only (torch types it for any state dict).
    state = cast(dict[str, torch.Tensor], get_model_state_dict(model))
    where = location(path)
    if fmt == "dcp":
        wrapped: dict[str, Any] = {"model": state}
        dcp_loader.load(wrapped, storage_reader=dcp_reader(dcp_checkpoint_path(where)),
                        planner=NoPickleLoadPlanner(), process_group=process_group)
        set_model_state_dict(model, wrapped["model"])
        return len(state)
    assert isinstance(where, Path)  # preflight refuses a remote hf or meta source
    spec = spec_for_args(args)
    source = HFSource(where, spec.state_dict_adapter) if fmt == "hf" else MetaSource(where, spec.meta_release)
    buffers = {fqn for fqn, _ in model.named_buffers()}
    filled: dict[str, Any] = {fqn: _read_release_tensor(source, fqn, value, args, fqn in buffers)
                              for fqn, value in state.items()}
    set_model_state_dict(model, filled)
    return len(filled)


def _read_release_tensor(source: HFSource | MetaSource, fqn: str, value: torch.Tensor, args: DecoderConfig,
                         buffer: bool) -> torch.Tensor:
    """Our ``fqn`` read from a release into the dtype, device and layout of ``value`` (the model's own)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if buffer:
        # A persistent buffer (an MoE router's bias) keeps its initial value unless the release names it
        # (DeepSeek-V3's e_score_correction_bias).
        name = _release_buffer(source, fqn)
        return value if name is None else source.read(fqn, args, None).to(value.dtype).to(value.device)
    if not isinstance(value, DTensor):
        return source.read(fqn, args, None).to(dtype=value.dtype, device=value.device)
    region = _region(value)
    if region is None:  # e.g. strided shards of FSDP x TP: split the full tensor locally, no communication
        full = source.read(fqn, args, None).to(value.dtype).to(value.to_local().device)
        return distribute_tensor(full, value.device_mesh, value.placements, src_data_rank=None)
    local = source.read(fqn, args, region).to(value.dtype)
    return DTensor.from_local(local.to(value.to_local().device), value.device_mesh, value.placements,
                              run_check=False, shape=value.shape, stride=value.stride())


def load_model(path: str | Path, fmt: str, args: DecoderConfig, *, device: torch.device,
               dtype: torch.dtype = torch.float32, tp_mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """The whole model of ``args`` on ``device`` in ``dtype`` (tensor parallel over ``tp_mesh``), in eval mode,
    its weights read by ``load_into``: generation, the export and the tests load a model this way.

    Built on the meta device and cast before the read, so every value is read once, in its dtype; the
    derived buffers that ``load_into`` rebuilds keep theirs (the rotary table stays float32).
    """
    spec = spec_for_args(args)
    with torch.device("meta"):
        model = spec.build(args)
    if tp_mesh is not None:
        model.apply_tp(tp_mesh, False, False)  # no sequence or loss parallelism
    model.to_empty(device=device)
    model.to(dtype)
    with warnings.catch_warnings():
        # DCP warns that it reads on a single process: that is what a one-process load does.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_into(model, str(path), fmt, args)
    return model.eval()


def checkpoint_model_shapes(path: Location) -> dict[str, tuple[int, ...]]:
    """Our FQN -> shape of every model tensor a checkpoint of this project holds (``path``: a step folder, or a
    checkpoint folder: its latest step), from its ``.metadata`` alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(dcp_checkpoint_path(path)).state_dict_metadata
    return {key[len("model."):]: tuple(md.size) for key, md in metadata.items()
            if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}


def model_shape_differences(path: Location, args: DecoderConfig) -> list[tuple[str, tuple | None, tuple | None]]:
    """(FQN, shape in the checkpoint, shape in ``args``'s model) of every model tensor in which the checkpoint
    at ``path`` and the model differ (None: absent there); empty when it holds exactly that model."""
    found, expected = checkpoint_model_shapes(path), expected_shapes(args, buffers=True)
    return [(k, found.get(k), expected.get(k)) for k in sorted(found.keys() | expected.keys())
            if found.get(k) != expected.get(k)]


# ---------------------------------------------------------------- writing a Hugging Face folder


def _shard_groups(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def check_export_target(out_dir: Path) -> str | None:
    """Why ``out_dir`` cannot receive an export (None: it can)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        return f"{out_dir} exists and is not an empty folder; export into a new or empty folder (nothing was written)"
    return None


def routing_bias_problem(state: dict[str, torch.Tensor], args: DecoderConfig) -> str | None:
    """Why ``state`` cannot be exported faithfully: a trained routing bias its family's format has no place for."""
    spec = spec_for_args(args)
    moved = [k for k, t in state.items() if k.endswith("router.expert_bias") and bool(t.abs().max() > 0)]
    if not moved or spec.model.release_holds_routing_bias:
        return None
    return (f"the checkpoint's routing bias (--moe.load_balance_coeff, e.g. {moved[0]}) has no place in a Hugging "
            f"Face {spec.name} folder, which would route tokens otherwise than the trained model; pass "
            "--drop_routing_bias to export without it (docs/moe.md), or train with --moe.load_balance_coeff=0")


def export_hf(state: dict[str, torch.Tensor], args: DecoderConfig, out_dir: str | Path, *, tokenizer=None,
              max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None,
              drop_routing_bias: bool = False) -> list[Path]:
    """Write ``state`` (our FQNs, full tensors) as a Hugging Face folder of the model's family (for Llama 3,
    ``LlamaForCausalLM``); returns the files.

    ``dtype``: of the written weights (None: as ``state`` holds them). A tied model writes the
    embedding only. A trained routing bias the format cannot hold is refused (``routing_bias_problem``)
    unless ``drop_routing_bias``. ``generation_config.json`` carries the tokenizer's BOS/EOS.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    problem = check_export_target(out) or (None if drop_routing_bias else routing_bias_problem(state, args))
    if problem:
        raise ValueError(problem)
    adapter = spec_for_args(args).state_dict_adapter
    hf = adapter.to_hf(state, args)
    hf = {name: hf[name] if dtype is None else hf[name].to(dtype) for name in sorted(hf, key=_hf_order)}
    dtypes = {t.dtype for t in hf.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    out.mkdir(parents=True, exist_ok=True)
    groups = _shard_groups(hf, max_shard_bytes)
    weight_map, written = {}, []
    for i, names in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: hf[n].contiguous() for n in names}, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
        written.append(out / file)
    total = sum(t.numel() * t.element_size() for t in hf.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    bos = eos = None
    if tokenizer is not None:
        bos, eos = tokenizer.bos_id, tokenizer.eos_id
    (out / "config.json").write_text(json.dumps(adapter.hf_config(args, bos_id=bos, eos_id=eos, dtype=dtype),
                                                indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}, indent=2))
    written += [out / INDEX_FILE, out / "config.json", out / "generation_config.json"]
    if tokenizer is not None:
        written += write_tokenizer(tokenizer, out, args.max_seq_len)
    return written


def write_tokenizer(tokenizer, out: Path, model_max_length: int) -> list[Path]:  # noqa: ANN001 - a Tokenizer
    """The tokenizer's own files, and for a tiktoken or SentencePiece one the ``tokenizer.json`` transformers'
    ``AutoTokenizer`` reads (``hf_tokenizer.py``), or a warning line saying why it was not written."""
    from torchtitan.checkpoint.hf_tokenizer import NotConverted, write_hf_tokenizer

    written = copy_tokenizer_files(tokenizer, out)
    if tokenizer.kind in ("tiktoken", "sentencepiece"):
        try:
            written += write_hf_tokenizer(tokenizer, out, model_max_length)
        except NotConverted as e:
            logger.warning("Export: %s", e)
    return written


def release_dtype(path: str | Path, fmt: str) -> torch.dtype | None:
    """The dtype of the weights in a Hugging Face or Meta release (None: not one, or mixed)."""
    folder = Path(path).expanduser()
    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    try:
        if fmt == "hf":
            source = HFSource(folder)
            found = {entry["dtype"] for file in set(source.file_of.values())
                     for entry in safetensors_header(folder / file).values()}
            return names.get(found.pop()) if len(found) == 1 else None
        if fmt == "meta":
            found = {t.dtype for t in MetaSource(folder).parts()[0].values()}
            return found.pop() if len(found) == 1 else None
    except (ValueError, OSError):
        return None
    return None


def copy_tokenizer_files(tokenizer, out: Path) -> list[Path]:
    """Hugging Face files go next to the weights, a SentencePiece model too (as ``tokenizer.model``); Meta's
    tiktoken file to ``original/`` as the hub lays it out."""
    if tokenizer.kind == "huggingface":
        targets = [(f, out / f.name) for f in tokenizer.files]
    elif tokenizer.kind == "tiktoken":
        targets = [(tokenizer.files[0], out / "original" / "tokenizer.model")]
    elif tokenizer.kind == "sentencepiece":
        targets = [(tokenizer.files[0], out / "tokenizer.model")]
    else:
        raise ValueError(f"the {tokenizer.kind} tokenizer {tokenizer.model_path} cannot be exported (Hugging Face, "
                         "tiktoken and SentencePiece ones are)")
    for src, dst in targets:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    return [dst for _, dst in targets]


def _hf_order(name: str) -> tuple:
    """Embedding, then layers in numeric order, then the final norm and the output projection."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if "embed" in name else 2, 0, name)


# ---------------------------------------------------------------- single-process export

def read_model_weights(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The model of any checkpoint (any layout) as ``{fqn: full tensor}``, read on one process.

    Needs no process group: DCP reads every shard itself.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(checkpoint_dir)
    metadata = read_dcp_metadata(path)
    template = {
        key: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    if not template:
        raise ValueError(f"checkpoint {path} holds no model weights")
    with warnings.catch_warnings():
        # DCP warns that it reads on a single process: that is the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_loader.load(template, storage_reader=dcp_reader(path), no_dist=True)  # .metadata: no pickle's code
    return {key[len("model."):]: value for key, value in template.items()}


def export_model_weights(checkpoint_dir: str | Path, output_file: str | Path) -> dict[str, torch.Tensor]:
    """Read the model of any checkpoint (any layout) on one process and ``torch.save`` it.

    The output is a plain ``{fqn: tensor}`` state dict with full tensors, which
    ``Transformer(args).load_state_dict(torch.load(output_file))`` accepts.
    """
    weights = read_model_weights(checkpoint_dir)
    torch.save(weights, output_file)
    return weights
