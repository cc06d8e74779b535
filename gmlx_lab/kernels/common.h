// Shared by every kernel body (after the backend prelude).

// Code `i` of a row of packed `B`-bit codes: stream bits [i*B, (i+1)*B), least significant first;
// stream bit j is bit j%32 of word j/32. `w` = (i*B)/32 and `sh` = (i*B)%32 are passed in because a
// thread reads the same column of many rows. Codes of 3, 5 and 6 bits may cross into word w+1.
#define EXTRACT_CODE(row, w, sh, B) \
  ((((row)[(w)] >> (sh)) | (((sh) + (B) > 32u) ? ((row)[(w) + 1] << (32u - (sh))) : 0u)) & ((1u << (B)) - 1u))

// Online softmax: the factor that rescales sums kept under the old maximum, and one weight.
// Both are -inf safe: nothing seen yet (m_old = -inf) or a masked score (s = -inf) give 0.
FN float rescale_factor(float m_old, float m_new) { return (m_old == NEG_INF) ? 0.0f : exp(m_old - m_new); }
FN float softmax_weight(float s, float m) { return (s == NEG_INF) ? 0.0f : exp(s - m); }
FN float clip_f(float x, float lo, float hi) { return fmin(fmax(x, lo), hi); }   // as mx.clip
