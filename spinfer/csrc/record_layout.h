// Where a low-bit weight's scales and zeros sit (format 4, spinfer/quant/lowbit.py): the one C++
// definition, read by the CUDA kernels (through lowbit_mm.h) and by the CPU codecs (cpu/codec.cpp,
// which the system compiler builds without CUDA's headers, hence plain C++ here).
//
// Scales and zeros are stored as one record per 64-row tile and group: [ceil(m/64), groups,
// record_words] 4-byte words, the record of tile tb and group j at word (tb * groups + j) *
// record_words. Word 8 b + i holds the scales of rows 16 b + i and 16 b + i + 8 of the tile
// (halves 0 and 1): the two rows an mma lane owns (b = 0..3, i = 0..7). The zeros follow at word
// 32: 32 words in the same order, in the dtype, or (nibble zeros) 8 words of 4-bit integers, word
// 32 + i holding row 16 b + i's zero at bit 4 b and row 16 b + i + 8's 16 bits higher: a lane's
// word is its own, and its shift is its warp's (the 16-row block's), so no lane keeps a shift in a
// register. A stage's scales and zeros of a 16-row block (the GEMV) or a 64-row one (the fused
// kernel) are then a few contiguous sectors; the 4-bit zeros cut a 4-bit g128 row group from 68 to
// 66.5 bytes and a 2-bit g64 one from 20 to 18.25 (docs/quant.md, sixty-eighth session). Padding
// rows hold zeros.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SPINFER_HOST_DEVICE __host__ __device__
#else
#define SPINFER_HOST_DEVICE
#endif

namespace spinfer {

constexpr int kRecordTileRows = 64;
constexpr int kRecordScaleWords = 32;
SPINFER_HOST_DEVICE constexpr int record_words(bool nibble_zeros) { return kRecordScaleWords + (nibble_zeros ? 8 : 32); }
// The first word of the record of 64-row tile tb and group j.
SPINFER_HOST_DEVICE inline int64_t record_word(int tb, int j, int groups, int words) {
  return (static_cast<int64_t>(tb) * groups + j) * words;
}
// Row r (0..63) of a tile: its scale word (scale in half (r % 16) / 8) and its zero word, and
// the zero's bit offset in that word.
SPINFER_HOST_DEVICE constexpr int scale_word_of(int r) { return 8 * (r / 16) + r % 8; }
SPINFER_HOST_DEVICE constexpr int zero_word_of(int r, bool nibble) {
  return kRecordScaleWords + (nibble ? r % 8 : scale_word_of(r));
}
SPINFER_HOST_DEVICE constexpr int zero_shift_of(int r, bool nibble) {
  return 16 * ((r % 16) / 8) + (nibble ? 4 * (r / 16) : 0);
}

}  // namespace spinfer
