// Grammar masks on CPU logits: token j of mask row i stays where bit (j % 32) of word
// j / 32 is set, else becomes -inf. Words are mostly all-clear or all-set in grammar
// masks, so whole words are filled or skipped and only mixed words go bit by bit.
#include <torch/extension.h>
#include <cstdint>
#include <limits>

void apply_bitmask(torch::Tensor logits, torch::Tensor mask, torch::Tensor rows) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.is_contiguous(), "logits: contiguous fp32");
  TORCH_CHECK(mask.dtype() == torch::kInt32 && mask.is_contiguous(), "mask: contiguous int32");
  TORCH_CHECK(rows.dtype() == torch::kInt64 && rows.numel() == mask.size(0), "rows: int64, one per mask row");
  const int64_t vocab = logits.size(1), words = mask.size(1);
  const float neg = -std::numeric_limits<float>::infinity();
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < mask.size(0); ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < logits.size(0), "row out of range");
    float* out = logits.data_ptr<float>() + row[i] * vocab;
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>()) + i * words;
    for (int64_t w = 0; w * 32 < vocab; ++w) {
      const uint32_t word = w < words ? bits[w] : 0u;  // past the mask: not allowed
      if (word == 0xffffffffu) continue;
      const int64_t start = w * 32, end = start + 32 < vocab ? start + 32 : vocab;
      if (word == 0u) {
        for (int64_t j = start; j < end; ++j) out[j] = neg;
        continue;
      }
      for (int64_t j = start; j < end; ++j)
        if (!((word >> (j - start)) & 1u)) out[j] = neg;
    }
  }
}
