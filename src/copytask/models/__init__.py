"""The models: one class per attention mechanism (`attention`; the dot-product scores in `dot_attention`
and linear attention in `linear_attention`, imported here so that they register), the GRU encoder and its
decoders (`recurrent`), the Transformer (`transformer`, its positions in `positions`), Mamba (`mamba`),
building a model from a config (`build`), greedy decoding of a batch (`greedy`) and beam search (`beam`),
and a model run over a batch in chunks in eval mode (`chunks`). The classical implementation the
benchmark and the tests hold them against is the benchmark's (`bench.reference`)."""

from . import dot_attention, linear_attention  # noqa: F401  (register the dot-product scores, then linear)
