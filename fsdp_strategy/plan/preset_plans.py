"""Tensor-parallel plans of the ``fsdp-plan`` presets: what a 2-D plan of a Hugging Face Llama applies.

torchtitan's Llama plan on Hugging Face's module names. In each decoder layer the attention's
``q/k/v_proj`` and the MLP's ``gate/up_proj`` are split by columns, ``o_proj`` / ``down_proj`` by
rows; the token embedding by rows, the head by columns (its logits replicated: Hugging Face's loss
takes whole logits, so torchtitan's loss parallel is left out). With sequence parallel (the
default, as torchtitan's) the norms and the residual stream run on sequence-sharded activations,
gathered before the attention and the MLP; without it every activation between the split layers
is whole on each rank. Hugging Face's attention reshapes by ``-1`` heads, so each rank runs its own
heads. Checked against one process (float64, 1x2, sequence parallel: loss and gradients equal). A
model of another shape is planned 2-D through ``--parallelize module:function``.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def llama_tensor_parallel(model: nn.Module, device_mesh: Any, sequence_parallel: bool = True) -> nn.Module:
    """Apply the plan above to a Hugging Face ``LlamaForCausalLM`` on ``device_mesh["tensor_parallel"]``;
    returns the model. Raises a ``ValueError`` naming the sizes the tensor-parallel size must divide."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = device_mesh["tensor_parallel"]
    config, size = model.config, mesh.size()
    split = {"num_key_value_heads": config.num_key_value_heads, "num_attention_heads": config.num_attention_heads}
    split |= {"intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    uneven = {name: value for name, value in split.items() if value % size}
    if uneven:
        raise ValueError(f"tensor_parallel_size={size} does not divide {uneven}; accepted: a size dividing each")
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream between the split layers
    top = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=stream, use_local_output=not sequence_parallel
        ),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
    }
    layer = {name: ColwiseParallel() for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}
    layer |= {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()}
    rowwise = RowwiseParallel(output_layouts=stream, use_local_output=not sequence_parallel)
    layer |= {"self_attn.o_proj": rowwise, "mlp.down_proj": rowwise}
    if sequence_parallel:
        top["model.norm"] = SequenceParallel()
        layer |= {"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel()}
        layer["self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": stream}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        )
        layer["mlp"] = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
    parallelize_module(model, mesh, top)
    for decoder in model.model.layers:
        parallelize_module(decoder, mesh, layer)
    return model
