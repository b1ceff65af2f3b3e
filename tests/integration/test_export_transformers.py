"""An export read by ``transformers``' own loader (issue #26): a tiny causal LM's training
state saved through `CheckpointManager`, exported with ``select="model"`` into a directory
beside the model's ``config.json``, and loaded with ``AutoModelForCausalLM.from_pretrained``
(one file, and a sharded index), every tensor compared with the original.

Tied embeddings: the model's state dict names the tied weight twice (``lm_head.weight`` and
``model.embed_tokens.weight``, one parameter), DCP saves both names and the export writes both,
where ``save_pretrained`` would leave ``lm_head.weight`` out; transformers loads the file and
ties the two again (one parameter in the loaded model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from s3ckpt import CheckpointManager, export_safetensors
from tests.conftest import S3Env


def _model(tied: bool) -> PreTrainedModel:
    """A two-layer Llama built from its config (no download), every weight overwritten with
    values its initialisation cannot produce: a weight that the loader re-initialised instead
    of loading shows."""
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(26)
    with torch.no_grad():
        for parameter in model.parameters():  # a tied weight is one parameter: set once
            parameter.copy_(torch.randn(parameter.shape, generator=generator) + 3)
    return model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("shard", [None, "20KB"], ids=["one-file", "sharded"])
def test_transformers_loads_the_exported_model(
    s3: S3Env, bucket: str, tmp_path: Path, tied: bool, shard: str | None
) -> None:
    model = _model(tied)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8).reshape(1, 8)).logits.sum().backward()
    optimizer.step()  # moments in the checkpoint, which the export must leave behind
    with CheckpointManager(f"s3://{bucket}/run", every=1, config=s3.config()) as mgr:
        mgr.save(1, {"model": model, "optim": optimizer}, sync=True)
    dest = tmp_path / "hf"
    url = f"s3://{bucket}/run/step-000000001"
    export_safetensors(url, dest, s3.config(), select="model", max_shard_size=shard or "5GB")
    model.config.save_pretrained(dest)

    if shard is None:
        assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]
    else:
        index = json.loads((dest / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert set(index["weight_map"]) == set(model.state_dict())
    loaded, info = AutoModelForCausalLM.from_pretrained(
        dest, local_files_only=True, output_loading_info=True
    )
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and info["error_msgs"] == [], info
    expected, actual = model.state_dict(), loaded.state_dict()
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and torch.equal(actual[name], tensor), name
    embed, head = loaded.model.embed_tokens.weight, loaded.lm_head.weight
    assert (head is embed) == tied  # tied again by the loader, or two separate weights
    assert torch.equal(head, embed) == tied
