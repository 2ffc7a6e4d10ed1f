// The Domino head's corrected drafts as one op: `draft.DominoDraft.draft_tokens` after its uncorrected prefix, the
// same ATen calls in the same order (fc2 through our linear kernel, as `packed_linear.PackedLinear` runs it at these
// rows), fp32 CPU. In Python each corrected draft is ~25 dispatched ops (the GRU cell, the projection, the greedy
// choice, the embedding of the choice), mostly fixed cost: as one op `draft_tokens` takes ~2/3 of the loop's time in
// a small pair's drafting step at one row and K = 8.
//
// domino_corrections(z [b, K, C] (the block's draft rows), base [b, K, V] (base logits), anchor [b],
//                    prefix [b, P] (the uncorrected drafts, target ids), embed [Vt, C] (the target's embedding),
//                    w_ih [3G, C], w_hh [3G, G] (the GRU's, gates r, z, n), fc1 [E, C + G], fc2 packed, fc2 rows V,
//                    d2t [V]? (draft -> target id offsets), num_draft)
//   -> drafts P..num_draft-1 [b, num_draft - P] (target ids)

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>

#include <vector>

#include "ops.h"

namespace {

// `draft.gru_cell`: nn.GRU's bias-free cell, x [b, C], state [b, G]
at::Tensor bias_free_gru_cell(const at::Tensor& x, const at::Tensor& state, const at::Tensor& w_ih,
                              const at::Tensor& w_hh) {
  const auto i = at::linear(x, w_ih).chunk(3, -1);
  const auto h = at::linear(state, w_hh).chunk(3, -1);
  const auto reset = at::sigmoid(i[0] + h[0]), update = at::sigmoid(i[1] + h[1]);
  const auto fresh = at::tanh(i[2] + reset * h[2]);
  return fresh + update * (state - fresh);
}

}  // namespace

namespace domino_ray {

at::Tensor domino_corrections(const at::Tensor& z, const at::Tensor& base, const at::Tensor& anchor,
                              const at::Tensor& prefix, const at::Tensor& embed, const at::Tensor& w_ih,
                              const at::Tensor& w_hh, const at::Tensor& fc1, const at::Tensor& fc2, int64_t fc2_rows,
                              const c10::optional<at::Tensor>& d2t, int64_t num_draft) {
  TORCH_CHECK(z.dim() == 3 && base.dim() == 3 && prefix.dim() == 2 && z.size(0) == prefix.size(0) &&
                  base.size(1) >= num_draft && z.size(1) >= num_draft && prefix.size(1) < num_draft &&
                  z.scalar_type() == at::kFloat && base.scalar_type() == at::kFloat,
              "domino_corrections: z [b, K, C], base [b, K, V] fp32, prefix [b, P] with P < num_draft <= K");
  const int64_t c = z.size(2), g = w_hh.size(1), p = prefix.size(1);
  TORCH_CHECK(fc1.size(1) == c + g, "domino_corrections: fc1 [E, C + G]");
  auto state = at::zeros({z.size(0), g}, z.options());
  const auto walked = at::embedding(embed, at::cat({anchor.unsqueeze(1), prefix}, 1));  // [b, P+1, C]
  for (int64_t j = 0; j <= p; ++j) state = bias_free_gru_cell(walked.select(1, j), state, w_ih, w_hh);
  const auto z_part = at::linear(z, fc1.narrow(1, 0, c));  // [b, K, E]
  const auto w_state = fc1.narrow(1, c, g);                // [E, G]
  std::vector<at::Tensor> drafts;
  for (int64_t i = p; i < num_draft; ++i) {
    const auto delta = linear(at::silu(z_part.select(1, i) + at::linear(state, w_state)), fc2, fc2_rows, {});
    auto token = std::get<1>((base.select(1, i) + delta).max(-1));  // [b], the first on ties (`verify.greedy_choice`)
    if (d2t.has_value() && d2t->defined()) token = token + d2t->index_select(0, token);
    drafts.push_back(token);
    if (i + 1 < num_draft) state = bias_free_gru_cell(at::embedding(embed, token), state, w_ih, w_hh);
  }
  return at::stack(drafts, 1);
}

}  // namespace domino_ray
