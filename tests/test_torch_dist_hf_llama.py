"""A Hugging Face Llama, tensor-parallel through its own `base_model_tp_plan` applied by torch's
`parallelize_module` on threadpar's rank threads, against the dense model. Runs where `transformers` is
installed (it is not part of the CI install: see notes/issue-19-c10d.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import threadpar

transformers = pytest.importorskip("transformers")

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def test_llama_through_its_own_tp_plan():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    with torch.random.fork_rng():  # the model draws from the default generator: keep the caller's state
        torch.manual_seed(0)
        template = transformers.LlamaModel(config).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(template)
    ref_out = ref(input_ids=ids).last_hidden_state
    ref_out.pow(2).mean().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    def body():
        model = copy.deepcopy(template)
        plan = {name: STYLES[style]() for name, style in config.base_model_tp_plan.items()}
        parallelize_module(model, threadpar.device_mesh(), plan)
        out = model(input_ids=ids).last_hidden_state
        out.pow(2).mean().backward()
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            for n, p in model.named_parameters()
        }
        return out.detach(), grads, type(model.layers[0].self_attn.q_proj.weight).__name__

    for out, grads, kind in threadpar.launch(body, world_size=2, devices="cpu", timeout=60):
        assert kind == "DTensor"
        torch.testing.assert_close(out, ref_out.detach())
        for name, want in ref_grads.items():
            torch.testing.assert_close(grads[name], want, msg=name)
