"""The training process: a small causal LM on Python's help texts, checkpointed with async_save.

It runs as ``python -m s3ckpt.tools.demo --child train --url s3://bucket/run ...`` so that the
demo can SIGKILL it. On start it resumes from the latest committed checkpoint under the URL, if
there is one. It reports every step, save and resume as one JSON line on stdout (`Events`); the
parent reads them to time the run, to know when an upload is under way, and to compare loss curves.

Exact continuation needs everything a step depends on in the checkpoint: the model, the optimizer
(moments and step counts), the data order (the batch generator's state) and the global RNG, plus
the same arithmetic, hence one thread and deterministic algorithms.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save

from ... import S3Reader, S3Writer
from .. import catalog

__all__ = ["Batches", "TinyLM", "corpus", "train"]

CONTEXT = 64
SEED = 0


class TinyLM(nn.Module):
    """A character-level causal transformer: 3.2 M parameters, 39 MB of state with AdamW."""

    def __init__(self, vocab: int, width: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(CONTEXT, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        logits: torch.Tensor = self.head(self.blocks(x, mask=self.mask, is_causal=True))
        return logits


def corpus() -> tuple[torch.Tensor, int]:
    """Python's own help topics (about 0.5 MB of English, shipped with every Python) as character
    ids, and the vocabulary size."""
    from pydoc_data.topics import topics

    text = "".join(topics[name] for name in sorted(topics))
    index = {char: i for i, char in enumerate(sorted(set(text)))}
    return torch.tensor([index[char] for char in text]), len(index)


class Batches:
    """Random windows of the corpus. Its state goes into every checkpoint, so that a resumed run
    draws exactly the batches the uninterrupted one draws."""

    def __init__(self, data: torch.Tensor, batch: int) -> None:
        self.data = data
        self.batch = batch
        self.generator = torch.Generator().manual_seed(SEED)
        self.drawn = 0

    def __next__(self) -> torch.Tensor:
        starts = torch.randint(
            0, len(self.data) - CONTEXT - 1, (self.batch,), generator=self.generator
        )
        self.drawn += 1
        return torch.stack([self.data[s : s + CONTEXT + 1] for s in starts.tolist()])

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.drawn = state["drawn"]


class Events:
    """One JSON line per event on stdout, whole even when the save's thread reports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "t": time.time(), **fields})
        with self._lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()


def training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, step: int
) -> dict[str, Any]:
    """Everything the next step depends on; also the template a resume loads into."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "data": batches.state_dict(),
        "rng": torch.get_rng_state(),
        "step": step,
    }


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in ``state``: what a save has to move, before any compression."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def _resume(
    url: str, model: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, emit: Events
) -> int:
    """Load the latest committed checkpoint under ``url``; the step to continue after (0: none)."""
    found = catalog.latest(url)
    if found is None:
        return 0
    started = time.time()
    state = training_state(model, optimizer, batches, 0)
    load(state, checkpoint_id=found.url, storage_reader=S3Reader(found.url))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    batches.load_state_dict(state["data"])
    torch.set_rng_state(state["rng"])
    emit("resume", url=found.url, step=state["step"], t0=started, t1=time.time())
    return int(state["step"])


def _report_saved(emit: Events, step: int) -> Callable[[Future[Any]], None]:
    """The save's done-callback: reports when the upload ended (from the save's thread)."""

    def report(done: Future[Any]) -> None:
        emit("saved", step=step, ok=done.exception() is None)

    return report


def train(url: str, steps: int, every: int, batch: int) -> None:
    """Train to ``steps``, saving ``url/step-NNNNN`` every ``every`` steps with ONE writer."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    emit = Events()
    data, vocab = corpus()
    model = TinyLM(vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = Batches(data, batch)
    start = _resume(url, model, optimizer, batches, emit)
    writer = S3Writer(url)  # also DCP's stager: its staging buffers are reused across saves
    pending: Future[Any] | None = None
    for step in range(start + 1, steps + 1):
        started = time.time()
        tokens = next(batches)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        emit("step", step=step, loss=loss.item(), t0=started, t1=time.time())
        if step % every:
            continue
        started = time.time()
        if pending is not None:
            pending.result()  # the writer saves one at a time; this also raises its failure
        state = training_state(model, optimizer, batches, step)
        future = async_save(state, checkpoint_id=f"{url}/step-{step:05d}", storage_writer=writer)
        assert isinstance(future, Future)  # the writer stages at once: no AsyncSaveResponse
        emit("save", step=step, t0=started, t1=time.time(), bytes=state_bytes(state))
        future.add_done_callback(_report_saved(emit, step))
        pending = future
    if pending is not None:
        pending.result()
    writer.close()
