"""The models: one class per attention mechanism (`attention`), the GRU encoder and its decoders
(`recurrent`), the Transformer (`transformer`), building a model from a config (`build`), greedy
decoding of a batch (`greedy`) and beam search (`beam`), and a model run over a batch in chunks in eval
mode (`chunks`). The classical implementation the benchmark and the tests hold
them against is the benchmark's (`bench.reference`)."""
