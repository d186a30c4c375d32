"""epdserve: serve an LLM colocated or with prefill/decode (and encode) disaggregated,
and measure, under the same load, whether splitting the work pays off."""

__version__ = "0.1.0"
