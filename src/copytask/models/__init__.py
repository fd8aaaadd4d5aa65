"""The models: one class per attention mechanism (`attention`), the GRU encoder and its decoders
(`recurrent`), the Transformer (`transformer`), Mamba (`mamba`), building a model from a config (`build`)
and greedy decoding of a batch, scored (`greedy`). The classical implementation the benchmark and the tests hold
them against is the benchmark's (`bench.reference`)."""
