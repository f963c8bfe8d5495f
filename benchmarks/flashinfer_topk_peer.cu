// A C entry point to FlashInfer's native ragged top-k (include/flashinfer/topk.cuh, fetched by
// benchmarks/peers_flashinfer.sh), for timing it beside ours. Benchmark code, not part of the
// package: it only forwards raw pointers to FlashInfer's own host dispatch.
//   algo 0: FlashInfer's dispatch heuristic; 1: its filtered kernel; 2: its multi-CTA radix.
#include <flashinfer/math.cuh>  // topk.cuh uses math:: without including it
#include <flashinfer/topk.cuh>

extern "C" int fi_topk_ragged(float* input, int* out, const int* offsets, int* lengths,
                              unsigned num_rows, unsigned k, unsigned max_len, void* row_states,
                              int algo, int graph_safe, void* stream) {
  using namespace flashinfer::sampling;
  auto* states = static_cast<RadixRowState*>(row_states);
  auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err;
  if (algo == 1) {
    err = FilteredTopKRaggedTransform<float, int>(input, out, offsets, lengths, nullptr, num_rows, k,
                                                  max_len, false, TopKTieBreak::None, s, graph_safe != 0);
  } else if (algo == 2) {
    err = RadixTopKRaggedTransformMultiCTA<float, int>(input, out, offsets, lengths, nullptr, num_rows,
                                                       k, max_len, states, false, s);
  } else {
    err = TopKRaggedTransformDispatch<float, int>(input, out, offsets, lengths, nullptr, num_rows, k,
                                                  max_len, states, false, TopKTieBreak::None, s,
                                                  graph_safe != 0);
  }
  return static_cast<int>(err);
}

// FlashInfer's top-k with its page-table epilogue (the form sparse attention reads): row r's
// selected position p written as page_table[r][p >> page_bits] << page_bits | (p's offset), through
// its ConfigurablePageTableKernelPolicy; algo as above (0 dispatch, 1 filtered, 2 multi-CTA radix).
extern "C" int fi_topk_page_table(float* input, int* out, const int* page_table, long long table_stride,
                                  int* lengths, unsigned num_rows, unsigned k, unsigned max_len,
                                  long long input_stride, unsigned page_bits, void* row_states, int algo,
                                  void* stream) {
  using namespace flashinfer::sampling;
  using Policy = ConfigurablePageTableKernelPolicy<int>;
  auto* states = static_cast<RadixRowState*>(row_states);
  auto s = static_cast<cudaStream_t>(stream);
  const Policy policy(nullptr, input_stride, page_bits);
  cudaError_t err;
  if (algo == 1) {
    err = FilteredTopKPageTableTransform<float, int, Policy>(input, out, page_table, table_stride, nullptr,
                                                             lengths, nullptr, nullptr, num_rows, k, max_len,
                                                             false, TopKTieBreak::None, s, false, policy);
  } else if (algo == 2) {
    err = RadixTopKPageTableTransformMultiCTA<float, int, Policy>(input, out, page_table, table_stride, nullptr,
                                                                  lengths, nullptr, nullptr, num_rows, k,
                                                                  max_len, states, false, s, policy);
  } else {
    err = TopKPageTableTransformDispatch<float, int, Policy>(input, out, page_table, table_stride, lengths,
                                                             nullptr, nullptr, num_rows, k, max_len, states,
                                                             false, TopKTieBreak::None, s, false, nullptr,
                                                             policy);
  }
  return static_cast<int>(err);
}

extern "C" int fi_row_states_bytes() { return static_cast<int>(sizeof(flashinfer::sampling::RadixRowState)); }
