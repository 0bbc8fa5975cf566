"""vLLM's `thinking_token_budget`: a request may think (write tokens after the reasoning
parser's start token, `<think>`) for at most `budget` tokens in a row; then its next token is
forced to the end token (`</think>`), and it goes on as it likes. Tokens of an open thinking
section in the prompt (a template that ends with `<think>`) count toward it, as in vLLM; each
new section starts a new count.

The state advances exactly when a token is appended to the request (the scheduler's
`update_from_output`), so a preempted request keeps a state consistent with the tokens it
keeps, as a grammar matcher does. A forced token is a row of the step's bitmask (the grammar
bitmask's layout) that allows that token alone.
"""

from __future__ import annotations

import numpy as np

from vllm_lite.wire import ThinkingBudget


class ThinkingBudgetState:
    __slots__ = ("budget", "start_id", "end_id", "in_think", "count")

    def __init__(self, spec: ThinkingBudget, prompt_token_ids: np.ndarray) -> None:
        self.budget, self.start_id, self.end_id = spec.budget, spec.start_id, spec.end_id
        starts = np.flatnonzero(prompt_token_ids == spec.start_id)
        ends = np.flatnonzero(prompt_token_ids == spec.end_id)
        last_start = int(starts[-1]) if len(starts) else -1
        last_end = int(ends[-1]) if len(ends) else -1
        self.in_think = last_start > last_end
        self.count = len(prompt_token_ids) - last_start - 1 if self.in_think else 0

    def accept(self, token_id: int) -> None:
        if token_id == self.start_id:
            self.in_think, self.count = True, 0
        elif token_id == self.end_id:
            self.in_think, self.count = False, 0
        elif self.in_think:
            self.count += 1

    def forced_token(self) -> int | None:
        """The end token once the open section has used the budget; None otherwise."""
        return self.end_id if self.in_think and self.count >= self.budget else None


def forced_token_rows(token_ids: list[int], num_words: int) -> np.ndarray:
    """Bitmask rows (int32 [n, num_words], bit t % 32 of word t // 32 = token t) that each allow
    one token."""
    rows = np.zeros((len(token_ids), num_words), dtype=np.int32)
    ids = np.asarray(token_ids, dtype=np.int64)
    rows[np.arange(len(ids)), ids // 32] = (np.ones(len(ids), dtype=np.uint32) << (ids % 32).astype(np.uint32)
                                            ).view(np.int32)
    return rows
