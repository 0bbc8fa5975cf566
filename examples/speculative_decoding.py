"""n-gram speculative decoding (vLLM's prompt lookup): replies that repeat their prompt, as
edits and rewrites do, come several tokens a step; greedy replies are the tokens of decoding
without drafts (in bf16 mind near-ties: README, "Speculative decoding").

    python examples/speculative_decoding.py                  # the demo model
    python examples/speculative_decoding.py /path/to/model
    python examples/speculative_decoding.py /path/to/Llama-3.1-8B-Instruct /path/to/EAGLE3-LLaMA3.1-Instruct-8B
    # the server: vllm-lite serve MODEL --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

With a second argument, an EAGLE head drafts instead (vLLM's methods "eagle" / "eagle3", read
from the head's name as vLLM reads it, else pass "method" yourself).
"""

import sys
import time

from vllm_lite import LLM, SamplingParams

TEXT = ("The committee met on Tuesday to review the budget. The members agreed to increase funding for the "
        "public library, to repair the roof of the town hall before winter, and to hire two more teachers.")


def main(model: str | None, eagle_head: str | None) -> None:
    speculative_config = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                           "prompt_lookup_min": 2} if eagle_head is None
                          else {"model": eagle_head, "num_speculative_tokens": 3})
    llm = LLM(model, max_model_len=1024, disable_log_stats=False, speculative_config=speculative_config)
    try:
        messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{TEXT}"}]
        start = time.perf_counter()
        output = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=80), use_tqdm=False)[0].outputs[0]
        elapsed = time.perf_counter() - start
        print(output.text)
        metrics = {metric.name: metric for metric in llm.get_metrics()}
        kept = metrics["vllm:spec_decode_num_accepted_tokens"].value
        drafted = metrics["vllm:spec_decode_num_draft_tokens"].value
        print(f"\n{len(output.token_ids)} tokens in {elapsed:.2f} s; {kept} of {drafted} draft tokens kept; "
              f"kept per draft position: {metrics['vllm:spec_decode_num_accepted_tokens_per_pos'].values}")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, sys.argv[2] if len(sys.argv) > 2 else None)
