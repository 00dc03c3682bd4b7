"""TIDE: LLM serving with speculative decoding whose draft keeps learning from live traffic."""
