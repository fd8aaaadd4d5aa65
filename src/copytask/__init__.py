"""copytask: GRU encoder-decoders with and without attention on the copy task, swept over length."""

__version__ = "0.1.0"
