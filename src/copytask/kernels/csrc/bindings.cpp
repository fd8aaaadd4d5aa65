// The Python module of copytask's CPU kernels (kernels/build.py builds it, kernels/ops.py calls it).
#include <torch/extension.h>

#include <vector>

using at::Tensor;

std::vector<Tensor> gru_forward(const Tensor& gi, const Tensor& h0, const Tensor& w_hh, const Tensor& b_hh,
                                const Tensor& mask, bool reverse);
std::vector<Tensor> gru_backward(const Tensor& grad_states, const Tensor& grad_final, const Tensor& gates,
                                 const Tensor& before, const Tensor& w_hh, const Tensor& mask, bool reverse);
std::vector<Tensor> additive_forward(const Tensor& queries, const Tensor& keys, const Tensor& v);
std::vector<Tensor> additive_backward(const Tensor& grad_scores, const Tensor& u, const Tensor& v);
std::vector<Tensor> bahdanau_forward(const Tensor& embedded, const Tensor& s0, const Tensor& keys,
                                     const Tensor& values, const Tensor& mask, const Tensor& w_q,
                                     const Tensor& v, const Tensor& w_ih, const Tensor& b_ih,
                                     const Tensor& w_hh, const Tensor& b_hh);
std::vector<Tensor> bahdanau_backward(const Tensor& grad_states, const Tensor& grad_contexts,
                                      const Tensor& grad_weights, const Tensor& weights, const Tensor& u,
                                      const Tensor& inputs, const Tensor& gates, const Tensor& before,
                                      const Tensor& values, const Tensor& w_q, const Tensor& v,
                                      const Tensor& w_ih, const Tensor& w_hh);
std::vector<Tensor> attention_forward(const Tensor& x, const Tensor& kv, const Tensor& mask, int64_t heads, bool causal);
std::vector<Tensor> attention_backward(const Tensor& grad_out, const Tensor& x, const Tensor& kv, const Tensor& out,
                                       const Tensor& lse, const Tensor& mask, int64_t heads, bool causal);
std::vector<Tensor> attention_step(const Tensor& q, const Tensor& keys, const Tensor& values, const Tensor& mask, int64_t S);
Tensor causal_conv_forward(const Tensor& inputs, const Tensor& weight, const Tensor& bias);
std::vector<Tensor> causal_conv_backward(const Tensor& grad_out, const Tensor& inputs, const Tensor& weight,
                                         const Tensor& bias);
std::vector<Tensor> selective_scan_forward(const Tensor& u, const Tensor& dt, const Tensor& mask, const Tensor& A,
                                           const Tensor& Bm, const Tensor& Cm, const Tensor& h0, const Tensor& D,
                                           const Tensor& z);
std::vector<Tensor> selective_scan_backward(const Tensor& grad_out, const Tensor& grad_final, const Tensor& u,
                                            const Tensor& dt, const Tensor& mask, const Tensor& A, const Tensor& Bm,
                                            const Tensor& Cm, const Tensor& h0, const Tensor& D, const Tensor& z);
Tensor transformer_layer(const Tensor& x, const Tensor& memory, const Tensor& mask, const std::vector<Tensor>& params,
                         int64_t heads, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gru_forward", &gru_forward, "one GRU layer's recurrence, forward (csrc/gru.cpp)");
  m.def("gru_backward", &gru_backward, "one GRU layer's recurrence, backward");
  m.def("additive_forward", &additive_forward, "the additive score of every (query, key) pair, forward (csrc/additive.cpp)");
  m.def("additive_backward", &additive_backward, "the additive score, backward");
  m.def("bahdanau_forward", &bahdanau_forward, "Bahdanau's decoder under teacher forcing, forward (csrc/bahdanau.cpp)");
  m.def("bahdanau_backward", &bahdanau_backward, "Bahdanau's decoder under teacher forcing, backward");
  m.def("attention_forward", &attention_forward, "multi-head scaled dot-product attention, forward (csrc/attention.cpp)");
  m.def("attention_backward", &attention_backward, "multi-head scaled dot-product attention, backward");
  m.def("attention_step", &attention_step, "one greedy decoding step's attention over a cache of keys and values");
  m.def("transformer_layer", &transformer_layer, "a Transformer encoder or decoder layer as one autograd node (csrc/layers.cpp)");
  m.def("causal_conv_forward", &causal_conv_forward, "Mamba's causal depthwise convolution and SiLU (csrc/mamba.cpp)");
  m.def("causal_conv_backward", &causal_conv_backward, "Mamba's causal depthwise convolution and SiLU, backward");
  m.def("selective_scan_forward", &selective_scan_forward, "Mamba's selective scan, D skip and gate (csrc/mamba.cpp)");
  m.def("selective_scan_backward", &selective_scan_backward, "Mamba's selective scan, D skip and gate, backward");
}
