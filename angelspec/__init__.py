"""AngelSpec: speculative decoding in production."""
__version__ = "0.1.0"
DEFAULT_MAX_LEN = 4096  # tokens of context (prompt + output) of a request slot, unless told
