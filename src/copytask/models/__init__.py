"""The models: one class per attention mechanism (`attention`), the GRU encoder and its decoders
(`recurrent`), the Transformer (`transformer`), the classical step-by-step implementation that
tests and the benchmark hold them against (`reference`), building a model from a config (`build`)
and greedy decoding of a batch, scored (`greedy`)."""
