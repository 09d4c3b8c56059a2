"""Structured outputs (vLLM's v1/structured_output): constrain a request's tokens to a JSON schema,
any JSON object, a regex, a choice among strings or an EBNF grammar, with xgrammar.

    request.py           StructuredOutputRequest: one request's compile future and matcher (no torch)
    backend_xgrammar.py  XgrammarBackend: tokenizer info, compiler, matchers, bitmasks (xgrammar, torch)
    manager.py           StructuredOutputManager: compiles off the step loop, caches compiled grammars
                         by spec, fills the step's bitmasks
"""

from vlite.structured_output.request import StructuredOutputRequest

__all__ = ["StructuredOutputRequest"]
