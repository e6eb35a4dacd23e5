// CPU decoder of TCA-BME weights, loaded with ctypes by spinfer/cpu_kernels.py.
//
// Plain C++17 with a C interface and no torch headers: it compiles in about a second with the
// system compiler, where a torch extension takes about a minute, and it runs beside any torch
// build (CPU or CUDA). The Python side passes data pointers of contiguous tensors and checks
// every size; this side still refuses a GroupTile whose run would read past `values`.
//
// Before it, the CPU path decoded with torch ops (spinfer/format/tca_bme.py: decode): a
// 4096x4096 weight at 50% took ~170 ms on two cores, 70x F.linear's time at one token. That
// decoder stays the reference the tests compare this one with, bit for bit.
//
// The unit of work is one row of a BitmapTile: a byte of its word, 8 adjacent elements of one
// weight row, whose stored values are the next popcount(byte) entries of the run. Built with
// SSSE3 (spinfer/cpu_kernels.py passes -mssse3 where the CPU has it), one PSHUFB from a 256-entry
// table spreads them into their places (zeros elsewhere) and one 16-byte store writes the row,
// so every element of the output is written once and nothing is cleared first; without it the
// same happens element by element.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#ifdef __SSSE3__
#include <tmmintrin.h>
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
    const int64_t m = w.m, k = w.k, gt_h = w.gt_h, gt_w = w.gt_w, n_values = w.n_values;
    const int64_t gk = (k + gt_w - 1) / gt_w;
    const int64_t words_per_tile = gt_h * gt_w / 64;
    for (int64_t gr = row0; gr < row1; ++gr) {
        for (int64_t gc = 0; gc < gk; ++gc) {
            const int64_t g = gr * gk + gc;
            const uint64_t* words = w.bitmap + g * words_per_tile;
            const int64_t start = w.offsets[g];
            int64_t stored = 0;
            for (int64_t i = 0; i < words_per_tile; ++i) stored += __builtin_popcountll(words[i]);
            if (start < 0 || start > n_values || stored > n_values - start) return false;
            const bool loads_inside = start + stored + 8 <= n_values;
            const uint16_t* v = w.values + start;
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

}  // namespace

extern "C" {

// Version of this interface; spinfer/cpu_kernels.py refuses a library that reports another.
int spinfer_cpu_abi_version() { return 1; }

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

}  // extern "C"
