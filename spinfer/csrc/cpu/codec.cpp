// CPU codecs of spinfer's compressed weights, loaded with ctypes by spinfer/cpu_kernels.py: the
// TCA-BME decoder and encoder, and the low-bit dequantizer.
//
// Plain C++17 with a C interface and no torch headers: it compiles in about a second with the
// system compiler, where a torch extension takes about a minute, and it runs beside any torch
// build (CPU or CUDA). The Python side passes data pointers of contiguous tensors and checks
// every size; this side still refuses a GroupTile whose run would read past `values`.
//
// Before them, the CPU path used torch ops (spinfer/format/tca_bme.py: decode and
// encode_reference, spinfer/quant/lowbit.py: dequantize): decoding a 4096x4096 weight took
// ~170 ms at 50% sparsity and ~160 ms at 4 bits on two cores, 70x F.linear's time at one token.
// Those stay the references the tests compare these with, bit for bit.
//
// TCA-BME. The unit of work is one row of a BitmapTile: a byte of its word, 8 adjacent elements
// of one weight row, whose stored values are the next popcount(byte) entries of the run. Built
// with SSSE3 (spinfer/cpu_kernels.py passes -mssse3 where the CPU has it), one PSHUFB from a
// 256-entry table spreads them into their places (zeros elsewhere) and one 16-byte store writes
// the row, so every element of the output is written once and nothing is cleared first; without
// it the same happens element by element. The encoder does the inverse with the inverse table.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "../record_layout.h"

#if defined(__SSE2__) || defined(__SSSE3__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// kSpread[mask]: PSHUFB controls that move value i of a row's run (bytes 2i, 2i + 1) to the
// column of the mask's i-th set bit; 0x80 (a zero byte) in the columns whose bit is clear.
constexpr std::array<std::array<uint8_t, 16>, 256> make_spread() {
    std::array<std::array<uint8_t, 16>, 256> t{};
    for (int mask = 0; mask < 256; ++mask) {
        int next = 0;
        for (int c = 0; c < 8; ++c) {
            const bool set = (mask >> c) & 1;
            t[mask][2 * c] = set ? static_cast<uint8_t>(2 * next) : 0x80;
            t[mask][2 * c + 1] = set ? static_cast<uint8_t>(2 * next + 1) : 0x80;
            next += set;
        }
    }
    return t;
}
alignas(16) constexpr auto kSpread = make_spread();

// The 8 elements of one BitmapTile row into dst[0..8): only the stored ones are read.
inline void spread_row_scalar(unsigned mask, const uint16_t* v, uint16_t* dst) {
    for (int c = 0; c < 8; ++c) {
        if ((mask >> c) & 1) {
            dst[c] = *v++;
        } else {
            dst[c] = 0;
        }
    }
}

struct TcaBme {
    const uint64_t* bitmap;
    const uint16_t* values;
    int64_t n_values;
    const int32_t* offsets;
    int64_t m, k, gt_h, gt_w;
};

// GroupTile g's run: its first value (*v) and whether every 8-value load of its BitmapTile rows
// stays inside the values array (*loads_inside). False where the run, as long as its bitmap's
// PopCount, would reach past the array (or start outside it).
inline bool group_tile_run(const TcaBme& w, int64_t g, const uint16_t** v, bool* loads_inside) {
    const int64_t words_per_tile = w.gt_h * w.gt_w / 64;
    const uint64_t* words = w.bitmap + g * words_per_tile;
    const int64_t start = w.offsets[g];
    int64_t stored = 0;
    for (int64_t i = 0; i < words_per_tile; ++i) stored += __builtin_popcountll(words[i]);
    if (start < 0 || start > w.n_values || stored > w.n_values - start) return false;
    *v = w.values + start;
    *loads_inside = start + stored + 8 <= w.n_values;
    return true;
}

// Row r of a BitmapTile: the 8 elements of `mask` (its byte r) from the values at v. With
// `simd`, one 16-byte load, shuffle and store, for a row inside the weight whose 8-value load
// stays inside the values array; otherwise element by element, writing `cols` (<= 8) of them.
inline void spread_row(unsigned mask, const uint16_t* v, uint16_t* dst, bool simd, int64_t cols) {
#ifdef __SSSE3__
    if (simd) {
        const __m128i run = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
        const __m128i ctl = _mm_load_si128(reinterpret_cast<const __m128i*>(kSpread[mask].data()));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_shuffle_epi8(run, ctl));
        return;
    }
#endif
    (void)simd;
    uint16_t row[8];
    spread_row_scalar(mask, v, row);
    std::memcpy(dst, row, sizeof(uint16_t) * static_cast<size_t>(std::min<int64_t>(cols, 8)));
}

// Exclusive prefix sums of the bytes' PopCounts of `word`, one per byte: byte r of the result is
// the number of set bits in bytes 0 .. r - 1 (at most 56: no carries between bytes). With them
// the 8 rows of a BitmapTile are independent, where adding each row's count to a pointer made a
// chain of ~4 cycles a row.
inline uint64_t byte_prefix(uint64_t word) {
    uint64_t c = word - ((word >> 1) & 0x5555555555555555ull);
    c = (c & 0x3333333333333333ull) + ((c >> 2) & 0x3333333333333333ull);
    c = (c + (c >> 4)) & 0x0f0f0f0f0f0f0f0full;  // byte r: PopCount of byte r
    return (c * 0x0101010101010101ull) << 8;      // byte r: the sum of bytes 0 .. r - 1
}

// One BitmapTile (8x8, `word`, values from v) to dst, rows ld elements apart. `rows` and `cols`
// (<= 8) clip it at the weight's edge; `whole`: inside the weight, and its rows' 8-value loads
// stay inside the values array.
inline void spread_tile(uint64_t word, const uint16_t* v, uint16_t* dst, int64_t ld, bool whole, int64_t rows,
                        int64_t cols) {
    const uint64_t prefix = byte_prefix(word);
    if (whole) {
        for (int r = 0; r < 8; ++r) {
            spread_row((word >> (8 * r)) & 0xffu, v + ((prefix >> (8 * r)) & 0xffu), dst + r * ld, true, 8);
        }
    } else {
        for (int r = 0; r < 8 && r < rows; ++r) {
            spread_row((word >> (8 * r)) & 0xffu, v + ((prefix >> (8 * r)) & 0xffu), dst + r * ld, false, cols);
        }
    }
}

// GroupTile rows [row0, row1) of the weight into `out` (row-major [m, k]); false if a run would
// read past the values. Rows and columns of the zero padding (>= m, >= k) are not written.
// (In output-row order, so that each row's stores ran together, it measured ~1.5x slower: the
// values of 8 BitmapTiles were read in turn, and the pointers lived in memory.)
bool decode_rows(const TcaBme& w, int64_t row0, int64_t row1, uint16_t* out) {
    // (locals: the vector stores may alias anything, and would make the compiler reload fields)
    const int64_t m = w.m, k = w.k, gt_h = w.gt_h, gt_w = w.gt_w;
    const int64_t gk = (k + gt_w - 1) / gt_w;
    const int64_t words_per_tile = gt_h * gt_w / 64;
    for (int64_t gr = row0; gr < row1; ++gr) {
        for (int64_t gc = 0; gc < gk; ++gc) {
            const int64_t g = gr * gk + gc;
            const uint64_t* words = w.bitmap + g * words_per_tile;
            const uint16_t* v;
            bool loads_inside;
            if (!group_tile_run(w, g, &v, &loads_inside)) return false;
            for (int64_t tr = 0; tr < gt_h / 16; ++tr) {
                for (int64_t tc = 0; tc < gt_w / 16; ++tc) {
                    // a TCTile's four BitmapTiles in column-major order: (0,0), (1,0), (0,1), (1,1)
                    for (int bt = 0; bt < 4; ++bt) {
                        const uint64_t word = *words++;
                        const int64_t r0 = gr * gt_h + tr * 16 + (bt & 1) * 8;
                        const int64_t c0 = gc * gt_w + tc * 16 + (bt >> 1) * 8;
                        if (r0 < m && c0 < k) {
                            const bool whole = loads_inside && r0 + 8 <= m && c0 + 8 <= k;
                            spread_tile(word, v, out + r0 * k + c0, k, whole, m - r0, k - c0);
                        }
                        v += __builtin_popcountll(word);
                    }
                }
            }
        }
    }
    return true;
}

// Splits `rows` row blocks over up to `threads` threads (contiguous ranges); each thread writes
// only its own rows of the output. Returns false if any range failed.
template <typename Fn>
bool parallel_rows(int64_t rows, int threads, Fn fn) {
    const int64_t t = std::max<int64_t>(1, std::min<int64_t>(threads, rows));
    if (t == 1) return fn(0, rows);
    std::vector<std::thread> pool;
    std::vector<char> ok(t, 1);
    for (int64_t i = 0; i < t; ++i) {
        const int64_t a = rows * i / t, b = rows * (i + 1) / t;
        pool.emplace_back([&, i, a, b] { ok[i] = fn(a, b); });
    }
    for (auto& th : pool) th.join();
    return std::all_of(ok.begin(), ok.end(), [](char c) { return c != 0; });
}

// ---- TCA-BME encoding ----

// kGather[mask]: PSHUFB controls that move the elements of a BitmapTile row whose bits are set
// in `mask` to the front, in column order (the inverse of kSpread); 0x80 after them.
constexpr std::array<std::array<uint8_t, 16>, 256> make_gather() {
    std::array<std::array<uint8_t, 16>, 256> t{};
    for (int mask = 0; mask < 256; ++mask) {
        int next = 0;
        for (int c = 0; c < 8; ++c) {
            if ((mask >> c) & 1) {
                t[mask][2 * next] = static_cast<uint8_t>(2 * c);
                t[mask][2 * next + 1] = static_cast<uint8_t>(2 * c + 1);
                ++next;
            }
        }
        for (int i = 2 * next; i < 16; ++i) t[mask][i] = 0x80;
    }
    return t;
}
alignas(16) constexpr auto kGather = make_gather();

// One BitmapTile row of the dense weight: its mask (bit c: element c's 16-bit pattern is not
// zero; so -0.0 and NaN are stored) and, with `values`, its stored elements written to
// values[0 .. 8) in column order (only the first popcount(mask) matter). `cols` (<= 8) clips the
// row at the weight's edge; `row` is null for a row past it.
inline unsigned gather_row(const uint16_t* row, int64_t cols, uint16_t* values) {
    if (row == nullptr || cols <= 0) return 0;
#ifdef __SSSE3__
    if (cols >= 8) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
        const __m128i zero = _mm_cmpeq_epi16(x, _mm_setzero_si128());
        const unsigned mask = ~static_cast<unsigned>(_mm_movemask_epi8(_mm_packs_epi16(zero, zero))) & 0xffu;
        if (values != nullptr) {
            const __m128i ctl = _mm_load_si128(reinterpret_cast<const __m128i*>(kGather[mask].data()));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(values), _mm_shuffle_epi8(x, ctl));
        }
        return mask;
    }
#endif
    unsigned mask = 0;
    int next = 0;
    for (int64_t c = 0; c < std::min<int64_t>(cols, 8); ++c) {
        if (row[c] != 0) {
            mask |= 1u << c;
            if (values != nullptr) values[next] = row[c];
            ++next;
        }
    }
    return mask;
}

struct Dense {
    const uint16_t* w;  // [m, k] row-major
    int64_t m, k, gt_h, gt_w;
};

// GroupTile (gr, gc) of the dense weight, in storage order: its bitmap words to `words` and, with
// `run`, its stored values to run[0 .. count) (run has room for gt_h * gt_w + 8). Returns count.
int64_t encode_group_tile(const Dense& d, int64_t gr, int64_t gc, uint64_t* words, uint16_t* run) {
    int64_t count = 0;
    for (int64_t tr = 0; tr < d.gt_h / 16; ++tr) {
        for (int64_t tc = 0; tc < d.gt_w / 16; ++tc) {
            for (int bt = 0; bt < 4; ++bt) {  // column-major: (0,0), (1,0), (0,1), (1,1)
                const int64_t r0 = gr * d.gt_h + tr * 16 + (bt & 1) * 8;
                const int64_t c0 = gc * d.gt_w + tc * 16 + (bt >> 1) * 8;
                uint64_t word = 0;
                for (int r = 0; r < 8; ++r) {
                    const uint16_t* row = r0 + r < d.m && c0 < d.k ? d.w + (r0 + r) * d.k + c0 : nullptr;
                    const unsigned mask = gather_row(row, d.k - c0, run == nullptr ? nullptr : run + count);
                    word |= static_cast<uint64_t>(mask) << (8 * r);
                    count += __builtin_popcount(mask);
                }
                *words++ = word;
            }
        }
    }
    return count;
}

// ---- the low-bit format (spinfer/quant/lowbit.py) ----

// The 16-bit value patterns as float32, exactly, and with no float32 subnormal on the way (a
// process may run with denormals flushed: torch.set_flush_denormal). fp16: normal numbers by
// rebiasing the exponent in the integer, subnormals as their integer mantissa times 2^-24
// (a normal float32), infinities and NaN with an all-ones exponent and their payload.
inline float fp16_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exponent = h & 0x7c00u, mantissa = h & 0x03ffu;
    uint32_t bits;
    if (exponent == 0x7c00u) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent == 0) {
        const float f = static_cast<float>(mantissa) * 0x1p-24f;
        std::memcpy(&bits, &f, 4);
        bits |= sign;
    } else {
        bits = sign | ((static_cast<uint32_t>(h & 0x7fffu) << 13) + ((127u - 15u) << 23));
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// float32 to fp16 / bf16, rounded to nearest even as torch's .to() rounds, in integer arithmetic
// (so no floating-point mode can change it). NaN becomes torch's scalar conversions' quiet NaN.
inline uint16_t float_to_fp16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00u;
    if (ax >= 0x477ff000u) return sign | 0x7c00u;  // from 65520 (a tie that rounds to even: 2^16) up: inf
    if (ax < 0x38800000u) {                         // below 2^-14: a subnormal fp16, or zero
        if (ax <= 0x33000000u) return sign;          // up to 2^-25 (a tie: to the even zero)
        const uint32_t shift = 126u - (ax >> 23);    // 14 .. 24: the fp16 unit 2^-24 in the mantissa
        const uint32_t mantissa = (ax & 0x7fffffu) | 0x800000u;
        uint32_t q = mantissa >> shift;
        const uint32_t rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
        q += rest > half || (rest == half && (q & 1u));
        return sign | static_cast<uint16_t>(q);     // (q = 0x400 is the least normal: right too)
    }
    const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);  // to nearest even at bit 13
    return sign | static_cast<uint16_t>((rounded - ((127u - 15u) << 23)) >> 13);
}

inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// kStreamIndex[b][c]: the index in a 128-column chunk's packed stream of column c's value at
// width 1 << b bits: the inverse of fragment_order (spinfer/quant/lowbit.py), where stream value
// j is word j / V, position p = j % V (V = 32 / bits); word t * bits + wi belongs to lane t; p is
// pair s = p % (V / 2), half e = p / (V / 2); and the column is 16 T + 4 t + 2 (s % 2) + e with
// T = wi V / 4 + s / 2.
constexpr std::array<std::array<uint8_t, 128>, 4> make_stream_index() {
    std::array<std::array<uint8_t, 128>, 4> t{};
    for (int b = 0; b < 4; ++b) {
        const int bits = 1 << b, v = 32 / bits;
        for (int j = 0; j < 128; ++j) {
            const int word = j / v, p = j % v, lane = word / bits, wi = word % bits;
            const int s = p % (v / 2), e = p / (v / 2);
            const int tile = wi * (v / 4) + s / 2;
            t[b][16 * tile + 4 * lane + 2 * (s % 2) + e] = static_cast<uint8_t>(j);
        }
    }
    return t;
}
constexpr auto kStreamIndex = make_stream_index();

// The direct low-bit kernel's slot order (lowbit_spmm_rows): a chunk's words are taken four at a
// time, and value p of the block's word w goes to slot 4 p + w of the block, so one SSE register
// holds value p of four words and the unpack shifts all four lanes alike. kXSlot[b][c]: the slot
// of column c's value; x is permuted into slot order once per call instead of the values into
// column order once per chunk.
constexpr std::array<std::array<uint8_t, 128>, 4> make_x_slot() {
    std::array<std::array<uint8_t, 128>, 4> t{};
    for (int b = 0; b < 4; ++b) {
        const int v = 32 >> b;
        for (int c = 0; c < 128; ++c) {
            const int j = kStreamIndex[b][c], word = j / v, p = j % v;
            t[b][c] = static_cast<uint8_t>(word / 4 * 4 * v + 4 * p + word % 4);
        }
    }
    return t;
}
constexpr auto kXSlot = make_x_slot();

// The columns of one word of a chunk lie in one aligned block of kWordSpan[b] columns (checked
// below), so where a group holds whole blocks, each word has one scale and zero.
constexpr std::array<int, 4> kWordSpan{128, 64, 32, 16};
constexpr bool words_within_span() {
    for (int b = 0; b < 4; ++b) {
        const int v = 32 >> b;
        for (int word = 0; word < 128 / v; ++word) {
            int lo = 128, hi = -1;
            for (int c = 0; c < 128; ++c) {
                if (kStreamIndex[b][c] / v == word) lo = std::min(lo, c), hi = std::max(hi, c);
            }
            if (lo / kWordSpan[b] != hi / kWordSpan[b]) return false;
        }
    }
    return true;
}
static_assert(words_within_span(), "a word's columns cross a kWordSpan block");

// The first column of each word of a chunk (any of its columns names its group, above).
constexpr std::array<std::array<uint8_t, 128>, 4> make_word_column() {
    std::array<std::array<uint8_t, 128>, 4> t{};
    for (int b = 0; b < 4; ++b) {
        for (int c = 127; c >= 0; --c) t[b][kStreamIndex[b][c] / (32 >> b)] = static_cast<uint8_t>(c);
    }
    return t;
}
constexpr auto kWordColumn = make_word_column();

struct LowBit {
    const uint32_t* qweight;   // [Mp/64, Kp/S, 64, S bits / 32]
    const uint16_t* scale_zero;  // [Mp/64, K/g, R] records: R = 80 with 4-bit zeros (nibble_zeros), else 128
    int64_t m, k, group_size;
    int bits;
    bool bf16;
    bool nibble_zeros;
};

// The scale and zero of row `row` and group g in float32, from the records (record_layout.h, the
// kernels' definition: 32 words of scales, each holding the two rows an mma lane owns, then the
// zeros in the dtype in the same order or 8 words of 4-bit integers).
template <bool kBf16>
inline void scale_zero_of(const LowBit& w, int64_t row, int64_t g, float& scale, float& zero) {
    const int words = spinfer::record_words(w.nibble_zeros);
    const uint16_t* const rec = w.scale_zero + 2 * spinfer::record_word(static_cast<int>(row / spinfer::kRecordTileRows),
                                                                        static_cast<int>(g),
                                                                        static_cast<int>(w.k / w.group_size), words);
    const auto word = [rec](int i) {  // (a copy: the halves' storage read as a word, with no alias or alignment assumed)
        uint32_t v;
        std::memcpy(&v, rec + 2 * i, sizeof v);
        return v;
    };
    const int r = static_cast<int>(row % spinfer::kRecordTileRows);
    const int half = spinfer::zero_shift_of(r, false);  // the row's half of its scale word (and of a dtype zero's)
    const uint32_t sw = word(spinfer::scale_word_of(r)), zw = word(spinfer::zero_word_of(r, w.nibble_zeros));
    const auto to_float = [](uint32_t bits) {
        return kBf16 ? bf16_to_float(static_cast<uint16_t>(bits)) : fp16_to_float(static_cast<uint16_t>(bits));
    };
    scale = to_float(sw >> half);
    zero = w.nibble_zeros ? static_cast<float>((zw >> spinfer::zero_shift_of(r, true)) & 15u) : to_float(zw >> half);
}

// Columns [c0, c0 + 128) of one row of the dequantized weight (those below k) into dst:
// ((q - zero) * scale) in float32, rounded once, as the reference computes it. The chunk's values
// are unpacked into column order first, then converted group by group. (The width is a template
// parameter: with a run-time width the divisions by 32 / bits were integer divisions, and the
// dequantizer ran at about half this speed.)
template <int kBits, bool kBf16>
void dequantize_chunk(const LowBit& w, int64_t row, int64_t c0, uint16_t* dst) {
    constexpr int kPerWord = 32 / kBits;
    constexpr uint32_t kMask = (1u << kBits) - 1;
    constexpr int64_t kStage = kBits == 8 ? 128 : 256, kStageWords = kStage * kBits / 32, kChunkWords = 4 * kBits;
    const int64_t k = w.k, group_size = w.group_size;
    const int64_t stages = (k + 255) / 256 * 256 / kStage;
    const uint8_t* const index = kStreamIndex[__builtin_ctz(static_cast<unsigned>(kBits))].data();
    const int64_t block = row / 64, r = row % 64;
    const uint32_t* words = w.qweight + ((block * stages + c0 / kStage) * 64 + r) * kStageWords +
                            (c0 % kStage) / 128 * kChunkWords;
    alignas(16) float q[128];
    for (int c = 0; c < 128; ++c) {
        const int j = index[c];
        q[c] = static_cast<float>((words[j / kPerWord] >> (kBits * (j % kPerWord))) & kMask);
    }
    const int64_t end = std::min<int64_t>(128, k - c0);
    for (int64_t c = 0; c < end;) {  // one group's segment at a time
        const int64_t g = (c0 + c) / group_size;
        const int64_t seg_end = std::min<int64_t>(end, (g + 1) * group_size - c0);
        float scale, zero;
        scale_zero_of<kBf16>(w, row, g, scale, zero);
#ifdef __F16C__
        if constexpr (!kBf16) {  // 4 at a time through the hardware's conversion (also RNE)
            const __m128 zv = _mm_set1_ps(zero), sv = _mm_set1_ps(scale);
            for (; c + 4 <= seg_end; c += 4) {
                const __m128 v = _mm_mul_ps(_mm_sub_ps(_mm_load_ps(q + c), zv), sv);
                _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + c),
                                 _mm_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            }
        }
#endif
        for (; c < seg_end; ++c) {
            const float v = (q[c] - zero) * scale;
            dst[c] = kBf16 ? float_to_bf16(v) : float_to_fp16(v);
        }
    }
}

// Rows [row0, row1) of the dequantized weight into `out` ([m, k] in the scales' dtype).
template <int kBits, bool kBf16>
void dequantize_rows(const LowBit& w, int64_t row0, int64_t row1, uint16_t* out) {
    for (int64_t row = row0; row < row1; ++row) {
        for (int64_t c0 = 0; c0 < w.k; c0 += 128) dequantize_chunk<kBits, kBf16>(w, row, c0, out + row * w.k + c0);
    }
}

// Where each word of a row's chunks takes its scale and zero: the same for every row. A chunk
// meets at most 4 groups (groups of 32 columns or more, kWordSpan): its first group `first[ch]`
// and, per word, the offset from it (0-3), or 4 for a word past k (a zero pair); `uniform[ch]`
// where every word has the same one.
struct ChunkGroups {
    std::vector<int32_t> first;
    std::vector<uint8_t> offset, uniform;
};

#ifdef __SSE2__
// Four float32 lanes rounded to the dtype's nearest (ties to even) and widened back: the values
// the reference's rounding gives. NaN stays NaN.
template <bool kBf16>
inline __m128 round_to_dtype(__m128 v) {
    if constexpr (kBf16) {
        const __m128i bits = _mm_castps_si128(v);
        const __m128i lsb = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
        const __m128i rounded = _mm_and_si128(_mm_add_epi32(bits, _mm_add_epi32(_mm_set1_epi32(0x7fff), lsb)),
                                              _mm_set1_epi32(static_cast<int>(0xffff0000u)));
        const __m128 nan = _mm_cmpunord_ps(v, v);
        return _mm_or_ps(_mm_and_ps(nan, v), _mm_andnot_ps(nan, _mm_castsi128_ps(rounded)));
    } else {
#ifdef __F16C__
        return _mm_cvtph_ps(_mm_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
        alignas(16) float f[4];
        _mm_store_ps(f, v);
        for (float& e : f) e = fp16_to_float(float_to_fp16(e));
        return _mm_load_ps(f);
#endif
    }
}

// One 128-column chunk of one row, dequantized as the reference dequantizes it (so the weight's
// values are the reference's), in float32 and in slot order (kXSlot) into wf; slots of columns
// past k get zeros. Needs one group a word (one_group_per_word).
template <int kBits, bool kBf16>
void dequantize_chunk_slots(const LowBit& w, int64_t row, int64_t c0, const ChunkGroups& cg, float* wf) {
    constexpr int kPerWord = 32 / kBits;
    constexpr int64_t kStage = kBits == 8 ? 128 : 256, kStageWords = kStage * kBits / 32, kChunkWords = 4 * kBits;
    const int64_t k = w.k, ngroups = k / w.group_size, ch = c0 / 128;
    const int64_t stages = (k + 255) / 256 * 256 / kStage;
    const int64_t block = row / 64, r = row % 64;
    const uint32_t* words = w.qweight + ((block * stages + c0 / kStage) * 64 + r) * kStageWords +
                            (c0 % kStage) / 128 * kChunkWords;
    // the chunk's pairs in float32, once; slot 4: a word past k
    alignas(16) float scale[5] = {}, zero[5] = {};
    const int32_t first = cg.first[ch];
    for (int i = 0; i < 4 && first + i < ngroups; ++i) scale_zero_of<kBf16>(w, row, first + i, scale[i], zero[i]);
    const uint8_t* const offset = cg.offset.data() + ch * kChunkWords;
    const bool uniform = cg.uniform[ch] != 0;
    __m128 sv = _mm_set1_ps(scale[offset[0]]), zv = _mm_set1_ps(zero[offset[0]]);
    const __m128i mask = _mm_set1_epi32((1 << kBits) - 1);
    for (int q4 = 0; q4 < kChunkWords / 4; ++q4) {
        if (!uniform) {
            const uint8_t* o = offset + 4 * q4;
            sv = _mm_setr_ps(scale[o[0]], scale[o[1]], scale[o[2]], scale[o[3]]);
            zv = _mm_setr_ps(zero[o[0]], zero[o[1]], zero[o[2]], zero[o[3]]);
        }
        const __m128i four = _mm_loadu_si128(reinterpret_cast<const __m128i*>(words + 4 * q4));
        float* out = wf + q4 * 4 * kPerWord;
        for (int p = 0; p < kPerWord; ++p) {
            const __m128i q = _mm_and_si128(_mm_srl_epi32(four, _mm_cvtsi32_si128(kBits * p)), mask);
            const __m128 v = _mm_mul_ps(_mm_sub_ps(_mm_cvtepi32_ps(q), zv), sv);
            _mm_store_ps(out + 4 * p, round_to_dtype<kBf16>(v));
        }
    }
    // A word that straddles k (one group a row, k not a multiple of its span) computed its padding
    // columns too: zeros there, as the column-order path, so that an infinite scale cannot put
    // inf * 0 = NaN into the sums through them.
    if (c0 + 128 > k) {
        const uint8_t* const slot = kXSlot[__builtin_ctz(static_cast<unsigned>(kBits))].data();
        for (int64_t c = k - c0; c < 128; ++c) wf[slot[c]] = 0.0f;
    }
}
#endif

// Whether dequantize_chunk_slots can take this weight: every word in one group, and at most 4
// groups a chunk (ChunkGroups). (The C interface takes any group size that divides k; the layer
// types take 32, 64, 128, 256 and per-channel.)
inline bool one_group_per_word(const LowBit& w) {
    const int b = __builtin_ctz(static_cast<unsigned>(w.bits));
    return (w.group_size % kWordSpan[b] == 0 && w.group_size >= 32) || w.group_size == w.k;
}

#ifdef __SSE2__
ChunkGroups chunk_groups(const LowBit& w) {
    const int b = __builtin_ctz(static_cast<unsigned>(w.bits)), words = 4 * w.bits;
    const int64_t chunks = (w.k + 127) / 128;
    ChunkGroups cg;
    cg.first.resize(static_cast<size_t>(chunks));
    cg.offset.resize(static_cast<size_t>(chunks * words));
    cg.uniform.resize(static_cast<size_t>(chunks));
    for (int64_t ch = 0; ch < chunks; ++ch) {
        cg.first[ch] = static_cast<int32_t>(ch * 128 / w.group_size);
        bool same = true;
        for (int i = 0; i < words; ++i) {
            const int64_t col = ch * 128 + kWordColumn[b][i];
            const uint8_t o = col < w.k ? static_cast<uint8_t>(col / w.group_size - cg.first[ch]) : uint8_t(4);
            cg.offset[ch * words + i] = o;
            same = same && o == cg.offset[ch * words];
        }
        cg.uniform[ch] = same;
    }
    return cg;
}
#endif

// `count` fp16 or bf16 values (their 16-bit patterns) widened to float32: F16C 4 at a time where
// present.
inline void widen(const uint16_t* src, int64_t count, bool bf16, float* dst) {
    int64_t c = 0;
#ifdef __F16C__
    if (!bf16) {
        for (; c + 4 <= count; c += 4) {
            _mm_storeu_ps(dst + c, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + c))));
        }
    }
#endif
    for (; c < count; ++c) dst[c] = bf16 ? bf16_to_float(src[c]) : fp16_to_float(src[c]);
}

// Rows [row0, row1) of y[N, M] = x[N, Kp] W^T in float32, straight from the low-bit arrays: each
// 128-column chunk of a row dequantized as the reference dequantizes it (so the weight's values
// are the reference's) into float32, then multiplied by each token's x into independent partial
// sums (4 of 8 with AVX, 4 of 4 with SSE2). x is float32, zero-padded to Kp (k rounded up to
// 128); with `groups` (SSE2, one group a word) the chunk is unpacked four
// words at a time in slot order and x comes permuted to match (kXSlot), else it is unpacked value
// by value into column order (dequantize_chunk). (Four rows at a time, loading each token's x
// slice once for all four, measured no faster: 4096x4096, 1-16 tokens, 2-8 bits.)
template <int kBits, bool kBf16>
void lowbit_spmm_rows(const LowBit& w, const float* x, int64_t n, int64_t row0, int64_t row1, float* y,
                      [[maybe_unused]] const ChunkGroups* groups) {
#if defined(__AVX__)
    constexpr int kAcc = 32;
#else
    constexpr int kAcc = 16;
#endif
    const int64_t k = w.k, kp = (k + 127) / 128 * 128;
    alignas(16) uint16_t chunk[128];
    alignas(32) float wf[128];
    std::vector<float> acc(static_cast<size_t>(n * kAcc));
    for (int64_t row = row0; row < row1; ++row) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t c0 = 0; c0 < k; c0 += 128) {
#ifdef __SSE2__
            if (groups != nullptr) {
                dequantize_chunk_slots<kBits, kBf16>(w, row, c0, *groups, wf);
            } else
#endif
            {
                std::fill(chunk, chunk + 128, uint16_t(0));  // columns past k: zero weights (x is zero there too)
                dequantize_chunk<kBits, kBf16>(w, row, c0, chunk);
                widen(chunk, 128, kBf16, wf);
            }
            for (int64_t t = 0; t < n; ++t) {
                const float* xt = x + t * kp + c0;
                float* a = acc.data() + kAcc * t;
#if defined(__AVX__)
                __m256 s[4];
                for (int i = 0; i < 4; ++i) s[i] = _mm256_loadu_ps(a + 8 * i);
                for (int c = 0; c < 128; c += 32) {
                    for (int i = 0; i < 4; ++i) {
                        const __m256 wv = _mm256_load_ps(wf + c + 8 * i), xv = _mm256_loadu_ps(xt + c + 8 * i);
#ifdef __FMA__
                        s[i] = _mm256_fmadd_ps(wv, xv, s[i]);
#else
                        s[i] = _mm256_add_ps(s[i], _mm256_mul_ps(wv, xv));
#endif
                    }
                }
                for (int i = 0; i < 4; ++i) _mm256_storeu_ps(a + 8 * i, s[i]);
#elif defined(__SSE2__)
                __m128 s[4];
                for (int i = 0; i < 4; ++i) s[i] = _mm_loadu_ps(a + 4 * i);
                for (int c = 0; c < 128; c += 16) {
                    for (int i = 0; i < 4; ++i) {
                        s[i] = _mm_add_ps(s[i], _mm_mul_ps(_mm_load_ps(wf + c + 4 * i), _mm_loadu_ps(xt + c + 4 * i)));
                    }
                }
                for (int i = 0; i < 4; ++i) _mm_storeu_ps(a + 4 * i, s[i]);
#else
                for (int c = 0; c < 128; ++c) a[c % kAcc] += wf[c] * xt[c];
#endif
            }
        }
        for (int64_t t = 0; t < n; ++t) {
            const float* a = acc.data() + kAcc * t;
            float sum = 0.0f;
            for (int i = 0; i < kAcc; ++i) sum += a[i];
            y[t * w.m + row] = sum;
        }
    }
}

template <int kBits>
void dequantize_rows_of(const LowBit& w, int64_t row0, int64_t row1, uint16_t* out) {
    if (w.bf16) {
        dequantize_rows<kBits, true>(w, row0, row1, out);
    } else {
        dequantize_rows<kBits, false>(w, row0, row1, out);
    }
}

template <int kBits>
void lowbit_spmm_rows_of(const LowBit& w, const float* x, int64_t n, int64_t row0, int64_t row1, float* y,
                         const ChunkGroups* groups) {
    if (w.bf16) {
        lowbit_spmm_rows<kBits, true>(w, x, n, row0, row1, y, groups);
    } else {
        lowbit_spmm_rows<kBits, false>(w, x, n, row0, row1, y, groups);
    }
}

// ---- a TCA-BME weight times a few tokens, without the dense weight ----

// Row-block partial products of y[N, M] = x[N, Kp] W^T: GroupTile rows [row0, row1), each into
// per-(row, token) 4-wide float32 sums that are added up once at the end. A BitmapTile row's 8
// values are spread as the decoder spreads them, widened to float32 and multiplied by the
// token's 8 x values. x is float32 and zero-padded to Kp (a multiple of gt_w), so padding
// columns read zeros; rows past m are summed and not stored.
template <bool kBf16>
bool spmm_rows(const TcaBme& w, const float* x, int64_t n, int64_t row0, int64_t row1, float* y) {
    const int64_t m = w.m, k = w.k, gt_h = w.gt_h, gt_w = w.gt_w;
    const int64_t gk = (k + gt_w - 1) / gt_w, kp = gk * gt_w;
    const int64_t words_per_tile = gt_h * gt_w / 64;
    std::vector<float> acc(static_cast<size_t>(gt_h * n * 4));
    for (int64_t gr = row0; gr < row1; ++gr) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t gc = 0; gc < gk; ++gc) {
            const int64_t g = gr * gk + gc;
            const uint64_t* words = w.bitmap + g * words_per_tile;
            const uint16_t* v;
            [[maybe_unused]] bool loads_inside;
            if (!group_tile_run(w, g, &v, &loads_inside)) return false;
            for (int64_t tr = 0; tr < gt_h / 16; ++tr) {
                for (int64_t tc = 0; tc < gt_w / 16; ++tc) {
                    for (int bt = 0; bt < 4; ++bt) {  // column-major: (0,0), (1,0), (0,1), (1,1)
                        const uint64_t word = *words++;
                        const int64_t r0 = tr * 16 + (bt & 1) * 8;  // in the GroupTile
                        const int64_t c0 = gc * gt_w + tc * 16 + (bt >> 1) * 8;
                        const uint64_t prefix = byte_prefix(word);
                        for (int r = 0; r < 8; ++r) {
                            const unsigned mask = static_cast<unsigned>(word >> (8 * r)) & 0xffu;
                            if (mask == 0) continue;
                            const uint16_t* rv = v + ((prefix >> (8 * r)) & 0xffu);
                            float* a = acc.data() + (r0 + r) * n * 4;
#if defined(__SSSE3__) && defined(__F16C__)
                            if (loads_inside) {  // in registers: 8 values, widened, times each token's 8 x
                                const __m128i run = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rv));
                                const __m128i halves = _mm_shuffle_epi8(
                                    run, _mm_load_si128(reinterpret_cast<const __m128i*>(kSpread[mask].data())));
                                __m128 l, h;
                                if constexpr (kBf16) {
                                    l = _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), halves));
                                    h = _mm_castsi128_ps(_mm_unpackhi_epi16(_mm_setzero_si128(), halves));
                                } else {
                                    l = _mm_cvtph_ps(halves);
                                    h = _mm_cvtph_ps(_mm_srli_si128(halves, 8));
                                }
                                const float* xt = x + c0;
                                for (int64_t t = 0; t < n; ++t, xt += kp) {
                                    const __m128 sum = _mm_add_ps(_mm_mul_ps(l, _mm_loadu_ps(xt)),
                                                                  _mm_mul_ps(h, _mm_loadu_ps(xt + 4)));
                                    _mm_storeu_ps(a + 4 * t, _mm_add_ps(_mm_loadu_ps(a + 4 * t), sum));
                                }
                                continue;
                            }
#endif
                            float lo[4], hi[4];
                            {
                                uint16_t row[8];
                                spread_row_scalar(mask, rv, row);
                                for (int c = 0; c < 4; ++c) {
                                    lo[c] = kBf16 ? bf16_to_float(row[c]) : fp16_to_float(row[c]);
                                    hi[c] = kBf16 ? bf16_to_float(row[c + 4]) : fp16_to_float(row[c + 4]);
                                }
                            }
                            for (int64_t t = 0; t < n; ++t) {
                                const float* xt = x + t * kp + c0;
                                for (int c = 0; c < 4; ++c) a[t * 4 + c] += lo[c] * xt[c] + hi[c] * xt[c + 4];
                            }
                        }
                        v += __builtin_popcountll(word);
                    }
                }
            }
        }
        const int64_t rows = std::min(gt_h, m - gr * gt_h);
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t t = 0; t < n; ++t) {
                const float* a = acc.data() + (r * n + t) * 4;
                y[t * m + gr * gt_h + r] = (a[0] + a[1]) + (a[2] + a[3]);
            }
        }
    }
    return true;
}

// x [n, k] (fp16 or bf16, contiguous) widened to float32 rows `ld` apart, zero-padded past k. The
// kernels take x in its own dtype and widen it here, not in torch: a torch copy of more than
// 32768 elements runs on torch's OpenMP threads, which then spin for milliseconds and took the
// second core from these kernels' threads (4096x4096 at 4 bits, 16 tokens, two cores: 9.2 ms
// called alone, 16.4 ms right after such a copy).
void widen_rows(const uint16_t* x, int64_t n, int64_t k, bool bf16, float* out, int64_t ld) {
    for (int64_t t = 0; t < n; ++t) {
        widen(x + t * k, k, bf16, out + t * ld);
        std::fill(out + t * ld + k, out + (t + 1) * ld, 0.0f);
    }
}

}  // namespace

extern "C" {

// Version of this interface; spinfer/cpu_kernels.py refuses a library that reports another.
int spinfer_cpu_abi_version() { return 7; }

// Dense [m, k] (row-major, the 16-bit patterns of the values' dtype) from TCA-BME arrays.
// Returns 0; 1 if a GroupTile's run reaches past `values` (out is then incomplete); 2 for
// arguments it cannot take.
int spinfer_tca_bme_decode(const uint64_t* bitmap, const uint16_t* values, int64_t n_values,
                           const int32_t* offsets, int64_t m, int64_t k, int64_t gt_h, int64_t gt_w,
                           uint16_t* out, int threads) {
    if (m < 1 || k < 1 || gt_h < 16 || gt_w < 16 || gt_h % 16 || gt_w % 16 || n_values < 0) return 2;
    const TcaBme w{bitmap, values, n_values, offsets, m, k, gt_h, gt_w};
    const bool ok = parallel_rows((m + gt_h - 1) / gt_h, threads,
                                  [&](int64_t a, int64_t b) { return decode_rows(w, a, b, out); });
    return ok ? 0 : 1;
}

// Dense [m, k] in the scales' dtype (the 16-bit patterns; bf16 != 0 for bf16, else fp16) from a
// low-bit weight: qweight [ceil(m / 64), Kp / S, 64, S bits / 32] (Kp = k rounded up to 256,
// S = 128 at 8 bits, else 256) and scale_zero [ceil(m / 64), k / group_size, R] records (R = 80
// halves where nibble_zeros != 0: 4-bit zeros, at 1, 2 and 4 bits only; else 128), the sizes
// spinfer/cpu_kernels.py checks. Columns in the stored K order (the caller undoes a permutation).
// Returns 0, or 2 for arguments it cannot take.
int spinfer_lowbit_dequantize(const uint32_t* qweight, const uint16_t* scale_zero, int64_t m, int64_t k, int bits,
                              int64_t group_size, int bf16, int nibble_zeros, uint16_t* out, int threads) {
    if (m < 1 || k < 1 || group_size < 1 || k % group_size || (bits != 1 && bits != 2 && bits != 4 && bits != 8) ||
        (nibble_zeros && bits == 8))
        return 2;
    const LowBit w{qweight, scale_zero, m, k, group_size, bits, bf16 != 0, nibble_zeros != 0};
    // rows in blocks of 64, so that threads do not share the cache lines of a tile's rows
    parallel_rows((m + 63) / 64, threads, [&](int64_t a, int64_t b) {
        const int64_t r0 = a * 64, r1 = std::min(m, b * 64);
        switch (bits) {
            case 1: dequantize_rows_of<1>(w, r0, r1, out); break;
            case 2: dequantize_rows_of<2>(w, r0, r1, out); break;
            case 4: dequantize_rows_of<4>(w, r0, r1, out); break;
            default: dequantize_rows_of<8>(w, r0, r1, out); break;
        }
        return true;
    });
    return 0;
}

// The scalar float32 -> fp16 / bf16 roundings of the dequantizer, for the tests to hold against
// torch's .to() on every kind of input (n values from `in` to `out`).
void spinfer_round_floats(const float* in, int64_t n, int bf16, uint16_t* out) {
    for (int64_t i = 0; i < n; ++i) out[i] = bf16 ? float_to_bf16(in[i]) : float_to_fp16(in[i]);
}

// TCA-BME encoding, pass 1: the bitmap (int64 [NBT]) and each GroupTile's count of stored
// values (int64 [NGT]) of a dense [m, k] weight (16-bit patterns, row-major).
int spinfer_tca_bme_count(const uint16_t* w, int64_t m, int64_t k, int64_t gt_h, int64_t gt_w, uint64_t* bitmap,
                          int64_t* counts, int threads) {
    if (m < 1 || k < 1 || gt_h < 16 || gt_w < 16 || gt_h % 16 || gt_w % 16) return 2;
    const Dense d{w, m, k, gt_h, gt_w};
    const int64_t gk = (k + gt_w - 1) / gt_w, words_per_tile = gt_h * gt_w / 64;
    parallel_rows((m + gt_h - 1) / gt_h, threads, [&](int64_t a, int64_t b) {
        for (int64_t gr = a; gr < b; ++gr) {
            for (int64_t gc = 0; gc < gk; ++gc) {
                const int64_t g = gr * gk + gc;
                counts[g] = encode_group_tile(d, gr, gc, bitmap + g * words_per_tile, nullptr);
            }
        }
        return true;
    });
    return 0;
}

// Pass 2: every GroupTile's run into values[offsets[g] .. offsets[g + 1]), its stored values
// followed by zeros (offsets from pass 1's counts, each rounded up to 8). Returns 0; 1 if a run
// does not fit its offsets or the values (nothing of it is written then); 2 for bad arguments.
int spinfer_tca_bme_pack(const uint16_t* w, int64_t m, int64_t k, int64_t gt_h, int64_t gt_w, const int32_t* offsets,
                         uint16_t* values, int64_t n_values, int threads) {
    if (m < 1 || k < 1 || gt_h < 16 || gt_w < 16 || gt_h % 16 || gt_w % 16 || n_values < 0) return 2;
    const Dense d{w, m, k, gt_h, gt_w};
    const int64_t gk = (k + gt_w - 1) / gt_w, words_per_tile = gt_h * gt_w / 64;
    const bool ok = parallel_rows((m + gt_h - 1) / gt_h, threads, [&](int64_t a, int64_t b) {
        std::vector<uint64_t> words(static_cast<size_t>(words_per_tile));
        std::vector<uint16_t> run(static_cast<size_t>(gt_h * gt_w + 8));  // (a row's 16-byte store past the count)
        for (int64_t gr = a; gr < b; ++gr) {
            for (int64_t gc = 0; gc < gk; ++gc) {
                const int64_t g = gr * gk + gc;
                const int64_t count = encode_group_tile(d, gr, gc, words.data(), run.data());
                const int64_t start = offsets[g], end = offsets[g + 1];
                if (start < 0 || end > n_values || end - start < count) return false;
                std::memcpy(values + start, run.data(), sizeof(uint16_t) * static_cast<size_t>(count));
                std::memset(values + start + count, 0, sizeof(uint16_t) * static_cast<size_t>(end - start - count));
            }
        }
        return true;
    });
    return ok ? 0 : 1;
}

// y[n, m] (float32) = x[n, k] (contiguous, in the values' dtype) times the TCA-BME weight's
// transpose, in float32, without the dense weight; bf16 != 0 for bf16 values and x, else fp16.
// Returns 0; 1 if a GroupTile's run reaches past `values` (y is then incomplete); 2 for arguments
// it cannot take.
int spinfer_tca_bme_spmm(const uint64_t* bitmap, const uint16_t* values, int64_t n_values, const int32_t* offsets,
                         int64_t m, int64_t k, int64_t gt_h, int64_t gt_w, int bf16, const uint16_t* x, int64_t n,
                         float* y, int threads) {
    if (m < 1 || k < 1 || n < 1 || gt_h < 16 || gt_w < 16 || gt_h % 16 || gt_w % 16 || n_values < 0) return 2;
    const TcaBme w{bitmap, values, n_values, offsets, m, k, gt_h, gt_w};
    const int64_t kp = (k + gt_w - 1) / gt_w * gt_w;
    std::vector<float> xf(static_cast<size_t>(n * kp));
    widen_rows(x, n, k, bf16 != 0, xf.data(), kp);
    const bool ok = parallel_rows((m + gt_h - 1) / gt_h, threads, [&](int64_t a, int64_t b) {
        return bf16 ? spmm_rows<true>(w, xf.data(), n, a, b, y) : spmm_rows<false>(w, xf.data(), n, a, b, y);
    });
    return ok ? 0 : 1;
}

// y[n, m] (float32) = x[n, k] (contiguous, in the scales' dtype) times the low-bit weight's
// transpose (stored K order), without the dense weight; arguments as spinfer_lowbit_dequantize's.
// Returns 0, or 2 for arguments it cannot take.
int spinfer_lowbit_spmm(const uint32_t* qweight, const uint16_t* scale_zero, int64_t m, int64_t k, int bits,
                        int64_t group_size, int bf16, int nibble_zeros, const uint16_t* x, int64_t n, float* y,
                        int threads) {
    if (m < 1 || k < 1 || n < 1 || group_size < 1 || k % group_size ||
        (bits != 1 && bits != 2 && bits != 4 && bits != 8) || (nibble_zeros && bits == 8))
        return 2;
    const LowBit w{qweight, scale_zero, m, k, group_size, bits, bf16 != 0, nibble_zeros != 0};
    // x in float32, zero-padded to Kp; for the slot-order unpack (where SSE2 and the groups allow
    // it) permuted within each chunk to match.
    const int64_t kp = (k + 127) / 128 * 128;
    std::vector<float> xf(static_cast<size_t>(n * kp));
    widen_rows(x, n, k, bf16 != 0, xf.data(), kp);
#ifdef __SSE2__
    ChunkGroups groups;
    const bool slots = one_group_per_word(w);
    if (slots) {
        groups = chunk_groups(w);
        const uint8_t* const slot = kXSlot[__builtin_ctz(static_cast<unsigned>(bits))].data();
        alignas(16) float chunk[128];
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t c0 = 0; c0 < kp; c0 += 128) {
                float* row = xf.data() + t * kp + c0;
                for (int c = 0; c < 128; ++c) chunk[slot[c]] = row[c];
                std::copy(chunk, chunk + 128, row);
            }
        }
    }
    const ChunkGroups* const g = slots ? &groups : nullptr;
#else
    const ChunkGroups* const g = nullptr;
#endif
    parallel_rows((m + 63) / 64, threads, [&](int64_t a, int64_t b) {
        const int64_t r0 = a * 64, r1 = std::min(m, b * 64);
        switch (bits) {
            case 1: lowbit_spmm_rows_of<1>(w, xf.data(), n, r0, r1, y, g); break;
            case 2: lowbit_spmm_rows_of<2>(w, xf.data(), n, r0, r1, y, g); break;
            case 4: lowbit_spmm_rows_of<4>(w, xf.data(), n, r0, r1, y, g); break;
            default: lowbit_spmm_rows_of<8>(w, xf.data(), n, r0, r1, y, g); break;
        }
        return true;
    });
    return 0;
}

}  // extern "C"
