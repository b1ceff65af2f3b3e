"""The demo: train a small language model with async checkpoints to S3, then restore it exactly.

``python -m s3ckpt.demo`` (``make demo``). With no endpoint configured (``--endpoint-url`` or
``AWS_ENDPOINT_URL[_S3]``) it starts a local SeaweedFS server and stops it at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from . import S3Config, S3Reader, S3Writer, bridge
from .transfer import get_transfer


class TinyLM(nn.Module):
    """A character-level causal transformer, small enough to train on a CPU in seconds."""

    def __init__(self, vocab: int, width: int = 256, layers: int = 4, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.blocks(x, mask=self.mask, is_causal=True))


@dataclass
class Row:
    step: int
    stall_ms: float
    upload_s: float
    megabytes: float


def corpus() -> str:
    """Python's own help topics: about 0.5 MB of English that ships with every Python."""
    from pydoc_data.topics import topics

    return "".join(topics[name] for name in sorted(topics))


def batches(text: str, context: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text])
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=generator)
        yield torch.stack([data[s : s + context + 1] for s in starts.tolist()])


def state_bytes(state: dict[str, object]) -> int:
    total = 0
    for value in state.values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            total += state_bytes(value)
    return total


@dataclass
class _Pending:
    step: int
    stall_s: float
    started: float
    megabytes: float
    future: Future[object]

    def finish(self) -> Row:
        self.future.result()
        return Row(
            self.step, self.stall_s * 1e3, time.perf_counter() - self.started, self.megabytes
        )


def train(config: S3Config, url: str, steps: int, every: int) -> list[Row]:
    torch.manual_seed(0)
    text = corpus()
    model = TinyLM(len(set(text)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows: list[Row] = []
    pending: _Pending | None = None
    data = batches(text, 64, 16, seed=0)
    for step in range(1, steps + 1):
        tokens = next(data)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if pending is not None and (pending.future.done() or step % every == 0):
            rows.append(pending.finish())
            pending = None
        if step % every == 0:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd, "step": step}
            writer = S3Writer(f"{url}/step-{step:05d}", config=config)
            started = time.perf_counter()
            future = dcp.async_save(state, storage_writer=writer)
            stall = time.perf_counter() - started
            pending = _Pending(step, stall, started, state_bytes(state) / 1e6, future)
            print(f"step {step:4d}  loss {loss.item():.3f}  checkpoint started")
    if pending is not None:
        rows.append(pending.finish())
    _check_restore(config, f"{url}/step-{rows[-1].step:05d}", model, optimizer, rows[-1].step)
    return rows


def _check_restore(
    config: S3Config, url: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> None:
    """Load the last checkpoint into a fresh model and optimizer; they must equal the live ones."""
    fresh = TinyLM(len(set(corpus())))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    model_sd, optim_sd = get_state_dict(fresh, fresh_optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    dcp.load(state, storage_reader=S3Reader(url, config=config))
    set_state_dict(fresh, fresh_optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    same = all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    )
    live_optim = get_state_dict(model, optimizer)[1]["state"]
    loaded_optim = get_state_dict(fresh, fresh_optimizer)[1]["state"]
    same_optim = all(
        torch.equal(torch.as_tensor(live_optim[k][name]), torch.as_tensor(loaded_optim[k][name]))
        for k in live_optim
        for name in live_optim[k]
    )
    if not (same and same_optim and state["step"] == step):
        raise SystemExit(f"restore from {url} does not match the trained state")
    print(f"restored {url}: model and optimizer state bit-identical to the live ones")


@contextlib.contextmanager
def endpoint(args: argparse.Namespace) -> Iterator[S3Config]:
    """The configured endpoint, or a local SeaweedFS started for the demo."""
    configured = (
        args.endpoint_url
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    if configured:
        yield S3Config(endpoint_url=args.endpoint_url)
        return
    from .localserver import SeaweedFS

    with (
        tempfile.TemporaryDirectory(prefix="s3ckpt-demo-") as workdir,
        SeaweedFS(workdir) as server,
    ):
        local = server.endpoint
        print(f"started a local SeaweedFS S3 server at {local.endpoint_url}")
        yield S3Config(
            endpoint_url=local.endpoint_url,
            access_key_id=local.access_key_id,
            secret_access_key=local.secret_access_key,
            region=local.region,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m s3ckpt.demo", description=__doc__)
    parser.add_argument(
        "--endpoint-url", help="S3 endpoint (default: AWS env, else a local server)"
    )
    parser.add_argument("--bucket", default="s3ckpt-demo")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with endpoint(args) as config:
        bridge.run(get_transfer(config).create_bucket(args.bucket))
        run = f"s3://{args.bucket}/demo-{int(time.time())}"
        rows = train(config, run, args.steps, args.every)
    print(f"\n{'step':>6} {'stall ms':>9} {'upload s':>9} {'MB':>8} {'MB/s':>8}")
    for row in rows:
        rate = row.megabytes / row.upload_s if row.upload_s else 0.0
        timing = f"{row.stall_ms:>9.1f} {row.upload_s:>9.2f}"
        print(f"{row.step:>6} {timing} {row.megabytes:>8.1f} {rate:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
