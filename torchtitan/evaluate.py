"""Validation: the loss on held-out data, evaluated during training, in every layout.

What is evaluated. The validation data is either a dataset of its own
(``validation.dataset`` / ``dataset_path``) or the documents of the training data
that ``validation.held_out_fraction`` holds out (``datasets/split.py``: a function of
each document's text and ``split_seed`` alone, so every layout holds out the same
documents and training never sees them). It is prepared once into a token store of
its own, cached like the training data's, and dealt out in global batches of
``batch_size x dp degree`` exactly like the training data, so with the same global
batch every layout evaluates the same windows, and each rank reads only its own. A
validation set on the hub is streamed instead, each DP rank reading its own
documents: its loss then depends on the DP degree, and an evaluation takes
``validation.steps`` batches, since such a stream has no common end.

The loss is the sum of the token cross-entropies over every evaluated token of every
rank, divided by the number of those tokens: the mean token loss of the evaluated
windows, whatever the layout (the parity tests check this against one process).
Perplexity is its exponential. Bits per byte is the same loss summed, in bits, per UTF-8 byte of the
text the evaluated tokens stand for (``datasets/token_bytes.py``): unlike the loss per token it
compares models with different tokenizers.

How it runs. Every model part goes into eval mode, and the batches go through the
same forward as training (CP sequence sharding, loss parallel under TP) under
``torch.no_grad()``; pipeline stages are chained by a forward-only pass
(``PipelineRunner.forward_only``). Nothing training depends on is touched: the
training data loader is not read, the optimizer not used, the global random
generators restored afterwards (nothing in the forward draws from them today; the
restore keeps it so), and the parameters FSDP gathered for the forward are freed
again, as after a training step. A run with validation therefore trains bitwise like
one without (tests/distributed/test_layout_parity.py).

Checks that need the data (is there at least one validation batch?) run in
``check_validation_data``, which ``torchtitan/preflight.py`` calls on every rank
before any process group exists; the options themselves are checked there too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from torchtitan.batch import Batch
from torchtitan.config.job_config import Model, Training, Validation
from torchtitan.datasets import DataLayout, HeldOutSplit, Tokenizer, build_validation_dataset, open_validation_store
from torchtitan.datasets.loaders import build_mixture_validation, document_bos
from torchtitan.datasets.store_dataset import TokenStoreDataset
from torchtitan.datasets.stream_dataset import ShardedStreamDataset
from torchtitan.distributed.collectives import reduce_scalar
from torchtitan.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)

# One dataset, or a mixture's held-out parts by source name (each evaluated and reported alone, and together).
ValidationData = TokenStoreDataset | ShardedStreamDataset | dict[str, TokenStoreDataset]


@dataclasses.dataclass(frozen=True)
class ValidationOptions:
    """What validation reads of a job: the ``[validation]`` section and the few ``[training]`` and ``[model]``
    values it shares with training; built once (``of``) by the preflight and by the trainer."""

    validation: Validation
    training: Training  # the training data (held out of, or mixed), its seq_len and local batch, the last step
    positions: bool  # block_causal masks: the batches carry positions, so validation masks as training does

    @classmethod
    def of(cls, validation: Validation, training: Training, model: Model) -> ValidationOptions:
        return cls(validation, training, positions=model.attn_mask_type == "block_causal")

    @property
    def batch_size(self) -> int:
        """The local validation batch: ``[validation] batch_size``, else training's."""
        return self.validation.batch_size or self.training.batch_size

    @property
    def per_source(self) -> bool:
        """A mixture without a validation dataset of its own validates on each source's held-out part."""
        v = self.validation
        return bool(self.training.dataset_mix) and v.dataset is None and v.dataset_path is None


def build_validation_data(options: ValidationOptions, tokenizer: Tokenizer, dp_rank: int,
                          dp_degree: int) -> ValidationData:
    v, t = options.validation, options.training
    layout = DataLayout(t.seq_len, options.batch_size, dp_rank, dp_degree)
    if options.per_source:
        return build_mixture_validation(
            t.dataset_mix, split=HeldOutSplit.from_config(v), tokenizer=tokenizer, layout=layout,
            positions=options.positions)
    return build_validation_dataset(
        dataset_name=v.dataset, dataset_path=v.dataset_path, train_dataset_name=t.dataset,
        train_dataset_path=t.dataset_path, split=HeldOutSplit.from_config(v), tokenizer=tokenizer, layout=layout,
        positions=options.positions,
    )


def check_validation_data(options: ValidationOptions, tokenizer: Tokenizer, dp_degree: int) -> list[str]:
    """Problems with the validation data (empty when fine); prepares its token store on first use."""
    v, t = options.validation, options.training
    if not v.enable:
        return []
    batch = options.batch_size
    needed = batch * dp_degree
    if options.per_source:
        return _check_source_parts(options, tokenizer, dp_degree)
    try:
        store = open_validation_store(dataset_name=v.dataset, dataset_path=v.dataset_path, train_dataset_name=t.dataset,
                                      train_dataset_path=t.dataset_path, split=HeldOutSplit.from_config(v),
                                      tokenizer=tokenizer)
        if store is not None and options.positions:
            document_bos(store)
    except (OSError, ValueError) as e:  # TokenStoreError is a ValueError; TimeoutError an OSError
        return [f"validation data: {e}"]
    if store is None:  # streamed from the hub: endless per rank, so a pass has no end of its own
        if v.steps == -1:
            return ["--validation.steps=-1 (the whole split) needs validation data in a token store, but it is "
                    "streamed from the hub, each DP rank reading its own documents; set --validation.steps=N "
                    "(batches per evaluation), or prepare the data with scripts/prepare_data.py"]
        return []
    found = store.n_tokens // (t.seq_len + 1)
    if found >= needed:
        return []
    what = (f"the held-out {v.held_out_fraction:g} of the training documents" if v.held_out_fraction is not None
            else f"the validation dataset {v.dataset_path or v.dataset}")
    return [f"validation data: {what} make(s) {found} window(s) of {t.seq_len + 1} tokens, fewer than "
            f"one validation batch (--validation.batch_size={batch} x data-parallel degree {dp_degree} = {needed}); "
            f"use more validation data (a larger --validation.held_out_fraction or dataset), or a smaller "
            f"--validation.batch_size or --training.seq_len"]


def _check_source_parts(options: ValidationOptions, tokenizer: Tokenizer, dp_degree: int) -> list[str]:
    """Each mixture source's held-out part must hold one validation batch; at least one source needs one."""
    t = options.training
    try:
        parts = build_mixture_validation(t.dataset_mix, split=HeldOutSplit.from_config(options.validation),
                                         tokenizer=tokenizer,
                                         layout=DataLayout(t.seq_len, options.batch_size, 0, dp_degree))
    except (OSError, ValueError) as e:
        return [f"validation data of the mixture: {e}"]
    if not parts:
        return ["validation data: no source of --training.dataset_mix has a held-out part; set "
                "--validation.held_out_fraction (sources prepared on first use), give a source table a "
                "validation_path, or set --validation.dataset_path"]
    return []


@dataclasses.dataclass(frozen=True)
class ValidationResult:
    loss: float  # mean token cross-entropy over every evaluated token
    tokens: int  # tokens evaluated, over all ranks
    batches: int  # global batches evaluated
    sources: dict[str, ValidationResult] = dataclasses.field(default_factory=dict)  # a mixture's, by source
    text_bytes: int = 0  # UTF-8 bytes of text the evaluated tokens stand for (datasets/token_bytes.py)

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    @property
    def bpb(self) -> float:
        """Bits per byte: the loss summed over the tokens, in bits, per byte of their text."""
        return self.loss * self.tokens / (self.text_bytes * math.log(2)) if self.text_bytes else math.nan

    def source_metrics(self) -> dict[str, float]:
        """``validation/{loss,bpb}/<source>`` of a mixture's held-out parts (empty otherwise)."""
        return {f"validation/{what}/{name}": getattr(r, what) for name, r in self.sources.items()
                for what in ("loss", "bpb")}

    def sources_line(self) -> str:
        """The per-source losses, compact, to follow the validation line (empty without sources)."""
        if not self.sources:
            return ""
        return "  per source: " + " ".join(f"{name} {r.loss:.5g} (bpb {r.bpb:.4g})" for name, r in self.sources.items())


class Validator:
    """Evaluates the model's loss on this rank's share of the validation data.

    ``forward_loss(batch)`` returns the loss sum of one local ``Batch`` (None on a
    pipeline rank without the last stage) and the number of tokens this rank scored
    (its CP share, a tensor on the device); the trainer supplies it so that validation runs exactly the forward
    that training runs.
    """

    def __init__(
        self,
        options: ValidationOptions,
        data: ValidationData,
        model_parts: list[torch.nn.Module],
        forward_loss: Callable[[Batch], tuple[torch.Tensor | None, torch.Tensor]],
        loss_mesh: DeviceMesh | None,
        pp_mesh: DeviceMesh | None,
        device: torch.device,
        byte_lengths: torch.Tensor,
        cp_degree: int = 1,
    ):
        v = options.validation
        # Bytes are counted from each rank's whole batch, which its CP peers hold too: their sum over
        # ``loss_mesh`` (dp x cp) counts every window cp_degree times.
        self.byte_lengths, self.cp_degree = byte_lengths, cp_degree
        self.freq, self.max_batches, self.last_step = v.freq, v.steps, options.training.steps
        self.data, self.model_parts, self.forward_loss = data, model_parts, forward_loss
        self.loss_mesh, self.pp_mesh, self.device = loss_mesh, pp_mesh, device
        self.parts = data if isinstance(data, dict) else {"": data}  # "": the one dataset
        self._warned_short: set[str] = set()

    def due(self, step: int) -> bool:
        """Every ``freq`` steps and at the last step."""
        return step % self.freq == 0 or step == self.last_step

    def _batches(self, data: TokenStoreDataset | ShardedStreamDataset) -> Iterator[tuple[torch.Tensor, ...]]:
        data.rewind()
        return iter(data)

    @torch.no_grad()
    def run(self) -> ValidationResult:
        """The loss over the validation data; for a mixture's parts also each part's, and the loss over all."""
        with evaluation_mode(self.model_parts, self.device):
            local = {name: self._evaluate(data) for name, data in self.parts.items()}
        results = {name: self._reduce(name, *found) for name, found in local.items()}
        if not isinstance(self.data, dict):
            return results[""]
        sums, tokens = sum(r.loss * r.tokens for r in results.values()), sum(r.tokens for r in results.values())
        return ValidationResult(loss=sums / tokens, tokens=tokens, batches=sum(r.batches for r in results.values()),
                                sources=results, text_bytes=sum(r.text_bytes for r in results.values()))

    def _reduce(self, name: str, local_sum: torch.Tensor, local_tokens: torch.Tensor | int, local_bytes: int,
                batches: int) -> ValidationResult:
        if self.max_batches > 0 and batches < self.max_batches and name not in self._warned_short:
            self._warned_short.add(name)
            logger.warning("validation%s: the data holds only %d global batch(es); --validation.steps=%d asks for "
                           "more, so each evaluation covers the whole split once", f" ({name})" if name else "",
                           batches, self.max_batches)
        loss_sum = reduce_scalar(local_sum, "sum", self.pp_mesh)  # only the last stage holds it
        loss_sum = reduce_scalar(loss_sum, "sum", self.loss_mesh)
        tokens = reduce_scalar(float(local_tokens), "sum", self.loss_mesh)
        text_bytes = round(reduce_scalar(float(local_bytes), "sum", self.loss_mesh)) // self.cp_degree
        return ValidationResult(loss=loss_sum / tokens, tokens=int(tokens), batches=batches, text_bytes=text_bytes)

    def _evaluate(self, data: TokenStoreDataset | ShardedStreamDataset
                  ) -> tuple[torch.Tensor, torch.Tensor | int, int, int]:
        local_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        local_tokens = local_bytes = batches = 0
        for batch in self._batches(data):  # (inputs, labels), and the positions under block_causal
            batch = Batch.of(batch)
            local_bytes += label_bytes(batch.labels, self.byte_lengths)
            loss, tokens = self.forward_loss(batch)
            if loss is not None:
                local_sum += loss.double()
            local_tokens += tokens
            batches += 1
            if batches == self.max_batches:
                break
        return local_sum, local_tokens, local_bytes, batches


@contextlib.contextmanager
def evaluation_mode(model_parts: list[torch.nn.Module], device: torch.device) -> Iterator[None]:
    """Evaluate without disturbing training: eval mode, the random generators restored, FSDP's gathered
    parameters freed after (the caller runs under ``torch.no_grad()``)."""
    modes = [part.training for part in model_parts]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for part in model_parts:
                part.eval()
            yield
    finally:
        for part, mode in zip(model_parts, modes):
            part.train(mode)
        _reshard(model_parts)


def label_bytes(labels: torch.Tensor, byte_lengths: torch.Tensor) -> int:
    """The bytes of text that the scored labels (all but ``IGNORE_INDEX``) stand for."""
    return int(byte_lengths[labels[labels != IGNORE_INDEX].cpu()].sum())


def _reshard(model_parts: list[torch.nn.Module]) -> None:
    """Free the parameters FSDP gathered for the forward (no backward comes to free them)."""
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

