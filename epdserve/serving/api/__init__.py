"""The OpenAI surface as epdserve speaks it: request and response models (:mod:`.openai`), error
bodies (:mod:`.errors`), fields outside the models (:mod:`.fields`), logprob shapes
(:mod:`.logprobs`), tool calls and their parsers, structured output, the incremental
detokenizer and image intake (:mod:`.multimodal`). No HTTP server and no sockets here.
"""

__all__ = ["detokenizer", "errors", "fields", "logprobs", "multimodal", "openai",
           "structured_output", "tool_calls", "tool_parsers"]
