"""n > 1: one prompt fans out into n child requests (ids f"{i}_{request_id}", vLLM's scheme)
that share the prompt's KV blocks through the prefix cache; their outputs fold back into one
RequestOutput with n CompletionOutputs."""

from __future__ import annotations

import msgspec

from vllm_lite.wire import EngineCoreRequest
from vllm_lite.outputs import CompletionOutput
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams

_SEED_MODULUS = 2**64


class ParentRequest:
    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.child_requests: set[str] = set()  # children not finished yet
        self.output_aggregator: list[CompletionOutput | None] = (
            [None] * params.n if params.output_kind == RequestOutputKind.FINAL_ONLY else [])
        self.prompt_logprobs = None  # child 0's, once it has them
        self.max_num_generation_tokens = 0  # of the children finished so far (vllm:request_max_num_generation_tokens)

    def child_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    def child_params(self, index: int) -> SamplingParams:
        """Each child samples once with its own seed (seed + index). Only child 0 computes
        prompt logprobs: the others then read the prompt's blocks from the prefix cache."""
        changes: dict[str, object] = {"n": 1}
        if self.params.seed is not None:
            seed = self.params.seed + index
            changes["seed"] = seed if seed < _SEED_MODULUS else seed % _SEED_MODULUS
        if index > 0 and self.params.prompt_logprobs is not None:
            changes["prompt_logprobs"] = None
        return self.params.clone_with(**changes)

    def get_outputs(self, child_id: str, completion: CompletionOutput) -> tuple[list[CompletionOutput], bool]:
        """What the parent emits for a child's new output, and whether every child is done.
        Streaming kinds pass each child's completion through; FINAL_ONLY waits for all n."""
        already_returned = False
        if completion.finished():
            if child_id in self.child_requests:
                self.child_requests.remove(child_id)
            else:
                already_returned = True
        if self.params.output_kind != RequestOutputKind.FINAL_ONLY:
            outputs = [] if already_returned else [completion]
        else:
            self.output_aggregator[completion.index] = completion
            outputs = [] if self.child_requests else list(self.output_aggregator)
        return outputs, not self.child_requests


def fan_out(request: EngineCoreRequest) -> list[tuple[EngineCoreRequest, ParentRequest | None, int]]:
    """(engine-core request, parent, index) for each sample of `request`."""
    params = request.sampling_params
    if params.n == 1:
        return [(request, None, 0)]
    parent = ParentRequest(request.request_id, params)
    children = []
    for index in range(params.n):
        child_id = parent.child_id(index)
        parent.child_requests.add(child_id)
        child = msgspec.structs.replace(request, request_id=child_id,
                                        sampling_params=parent.child_params(index))
        children.append((child, parent, index))
    return children
