"""Grammar-constrained decoding (vLLM's structured outputs) on the engine-core side.

`backend.py` is the interface a grammar engine implements; `xgrammar_backend.py` the default
one; `manager.py` compiles grammars off the busy loop (a thread pool, cached by grammar) and
fills the step's token bitmask for the constrained requests the scheduler will sample.
"""

from vllm_lite.structured_output.backend import (CompiledGrammar, GrammarMatcher, StructuredOutputBackend,
                                                 grammar_spec)
from vllm_lite.structured_output.manager import StructuredOutputManager, StructuredOutputRequest

__all__ = ["CompiledGrammar", "GrammarMatcher", "StructuredOutputBackend", "StructuredOutputManager",
           "StructuredOutputRequest", "grammar_spec"]
