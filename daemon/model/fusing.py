"""Fusing a checkpoint's per-expert matrices into one tensor per layer, each expert copied once, straight in.

transformers 5 keeps a mixture-of-experts layer's experts as fused tensors (``experts.gate_up_proj`` of
``[experts, 2 * intermediate, hidden]``, ``experts.down_proj``), while checkpoints hold each expert's matrices
under its own key. Its loader fuses them with two conversion operations: ``MergeModulelist`` stacks the
experts' matrices, then ``Concatenate`` joins gate and up. Each makes a whole new tensor, so while one layer
loads it is held three times: the checkpoint's pages it was read from (still mapped), the stacks, the join.
A checkpoint of a few large MoE layers then peaks near twice its weights.

:func:`fuse_in_place` swaps that pair (or a lone ``MergeModulelist``) for :class:`StackExperts`, which makes the
fused tensor once and copies each expert's matrix into its place, letting go of the file pages it came from
as it goes: a layer loads in its own bytes plus one expert's.

A node loading its layers in 4 bits (``--quantize int4``) has :class:`StackExperts` quantize each expert as it
comes (:mod:`daemon.model.int4`) into the experts module's 4-bit stacks: a layer's float experts are never held
whole, only one expert's matrix at a time. A Qwen3.5-MoE-shaped layer's fused bfloat16 experts are 1.5 GiB, more
than three times their 4-bit bytes.
"""

from __future__ import annotations

import copy

import torch
from transformers.core_model_loading import Concatenate, ConversionOps, MergeModulelist, WeightConverter

from daemon.host import file_mappings, release_tensor_pages


class StackExperts(ConversionOps):
    """``MergeModulelist(dim=0)``, then ``Concatenate(dim=concat_dim)`` when given, in one pass: the same tensor,
    each source pattern's experts in order along ``concat_dim``."""

    def __init__(self, concat_dim: int | None = None, quantize: str | None = None):
        self.concat_dim = concat_dim
        self.quantize = quantize  # "int4": experts of a layout int4 takes go straight into 4-bit stacks

    @torch.no_grad()
    def convert(self, input_dict: dict[str, list[torch.Tensor]], source_patterns: list[str],
                target_patterns: list[str], **kwargs) -> dict[str, torch.Tensor]:
        # in the source patterns' order (gate before up), as Concatenate joins them
        lists = [input_dict.pop(pattern) for pattern in source_patterns if pattern in input_dict]
        if self.concat_dim is None and len(lists) != 1 or len(target_patterns) != 1 or not lists:
            raise ValueError(f"cannot stack {source_patterns} into {target_patterns}")
        first = lists[0][0]
        experts = len(lists[0])
        axis = 0 if self.concat_dim is None else self.concat_dim - 1  # the join's axis in one expert's matrix
        for tensors in lists:
            for tensor in tensors:
                if (len(tensors) != experts or tensor.dim() != first.dim() or tensor.dtype != first.dtype
                        or any(a != b for i, (a, b) in enumerate(zip(tensor.shape, first.shape)) if i != axis)):
                    raise ValueError(f"experts of {source_patterns} differ in count, shape or dtype")
        sizes = [tensors[0].shape[axis] for tensors in lists]
        shape = list(first.shape)
        shape[axis] = sum(sizes)
        mappings = file_mappings() if first.device.type == "cpu" else []
        target = self._quantized_target(kwargs.get("model"), kwargs.get("full_layer_name"), shape)
        if target is not None:
            from daemon.model import int4

            module, name = target
            matrices = _expert_matrices(lists, axis, mappings)
            int4.install_stack(module, name, *int4.quantize_stack(matrices, experts, *shape, first.device))
            return {}  # nothing left for the loader to set: the module holds the 4-bit stack in its place
        fused = torch.empty((experts, *shape), dtype=first.dtype, device=first.device)
        offset = 0
        for tensors, size in zip(lists, sizes):
            for expert in range(experts):
                source = tensors[expert]
                fused[expert].narrow(axis, offset, size).copy_(source)
                if mappings:
                    release_tensor_pages(source, mappings)
                tensors[expert] = None  # a cast copy is freed here, not with the whole list
            offset += size
        return {target_patterns[0]: fused}

    def _quantized_target(self, model, full_name: str | None, shape: list[int]):
        """``(experts module, stack name)`` where this stack is to be quantized as it is made: int4 wanted, the
        target a stack of an experts module int4 takes (:func:`daemon.model.experts.known_layout`), its rows whole
        blocks; else None (the float stack is made, and the layer's quantizer judges it)."""
        if self.quantize != "int4" or model is None or not full_name:
            return None
        from daemon.model import int4
        from daemon.model.experts import known_layout

        module_name, _, name = full_name.rpartition(".")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            return None
        if name not in int4.EXPERT_STACKS or not known_layout(module) or shape[-1] % int4.BLOCK:
            return None
        return module, name


def _expert_matrices(lists: list[list[torch.Tensor | None]], axis: int, mappings):
    """Each expert's matrix in turn, its sources joined along ``axis``; the file pages a matrix came from leave
    the resident set once the next is asked for."""
    for expert in range(len(lists[0])):
        sources = [tensors[expert] for tensors in lists]
        yield sources[0] if len(sources) == 1 else torch.cat(sources, dim=axis)
        for tensors, source in zip(lists, sources):
            if mappings:
                release_tensor_pages(source, mappings)
            tensors[expert] = None


def fuse_in_place(transform, quantize: str | None = None):
    """``transform`` (one entry of a model's weight conversion mapping) with its expert stacking done by
    :class:`StackExperts` (which quantizes as it stacks for ``quantize`` "int4"); any other transform as it is."""
    if not isinstance(transform, WeightConverter):
        return transform
    ops = transform.operations
    concat_dim = None
    if len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim >= 1:
        concat_dim = ops[1].dim
    elif len(ops) != 1 or len(transform.source_patterns) != 1:
        return transform
    if type(ops[0]) is not MergeModulelist or ops[0].dim != 0 or len(transform.target_patterns) != 1:
        return transform
    fused = copy.copy(transform)
    fused.operations = [StackExperts(concat_dim, quantize)]
    return fused
