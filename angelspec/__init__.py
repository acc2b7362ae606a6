"""AngelSpec: speculative decoding in production."""
__version__ = "0.1.0"
