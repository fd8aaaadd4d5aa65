"""Optional CPU speed paths: C++ kernels (`csrc/`) that compute torch's own definition of the
models' recurrences and attention, built on first use (`build`) and wrapped as torch custom ops
(`ops`). Never required: without a compiler the models run torch's ops."""
