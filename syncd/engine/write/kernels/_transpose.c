/* Cache-blocked transpose of a row-major matrix of 1, 2, 4 or 8-byte elements, bit for bit.
 *
 * Elements are moved as unsigned integers of their width, never as floats, so every bit pattern
 * (signalling NaNs included) arrives unchanged. The matrix is walked in TILE x TILE tiles so that both the
 * rows read and the rows written stay in L1 while a tile is moved.
 *
 * Plain C with no Python header: syncd.engine.write.kernels.compiled loads it with ctypes (which releases the
 * GIL for the call, so transposes on several threads use several cores) and checks every geometry against
 * the buffers' sizes before calling. Needing no Python headers is what lets `pip install` build it wherever
 * a C compiler runs, the one that a `ziglang` wheel brings included (setup.py).
 *
 * syncd_transpose(src, dst, rows, cols, itemsize, src_stride, src_col, dst_stride, dst_col):
 * dst[c, dst_col + r] = src[r, src_col + c] for r < rows, c < cols, rows of src src_stride elements apart and
 * rows of dst dst_stride apart: a band of columns of a larger matrix can be transposed without copying it out.
 * syncd_check(src, dst, ..., samples, seed) (same geometry): the in-cache check of a transposed block, in C so
 * that a transposing conversion never needs numpy (its import and its per-block calls cost 0.25 s of CPU per
 * GiB).
 * syncd_pwrite_pieces(fd, buf, count, segment, offset, stride): the `count` pieces of `segment` bytes of buf,
 * laid end to end, written at offset, offset + stride, ...: the output-row pieces of a tensor transposed in
 * strips, in one call instead of one Python call per piece.
 * syncd_pread_pieces(fd, buf, count, segment, offset, stride, first_row, total_rows, chunk): the reverse, `count`
 * pieces read from offset, offset + stride, ...: a group of columns of a tensor read row piece by row piece, each
 * placed as rows first_row... of a block laid out in bands of `chunk` bytes.
 * syncd_copy_pieces(src, dst, count, segment, stride, first_row, total_rows, chunk): the same pieces taken from a
 * buffer already read (the read for the hash) instead of the file.
 * syncd_piece_sums(buf, rows, stride, row_bytes, piece_bytes, seed, out, out_stride, first_word, add): a 64-bit
 * checksum of every piece of every row, which binds the two reads of a tensor taken by columns (onepass.py).
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

typedef ptrdiff_t isize; /* sizes and strides, in elements or bytes: signed, as index arithmetic wants */

#if defined(__GNUC__) || defined(__clang__)
#define EXPORT __attribute__((visibility("default")))
#else
#define EXPORT
#endif

#define TILE 32

#define DEFINE_TRANSPOSE(NAME, T)                                                               \
    static void NAME(const T *src, T *dst, isize rows, isize cols, isize sstride, isize stride) { \
        for (isize r0 = 0; r0 < rows; r0 += TILE) {                                         \
            isize r1 = r0 + TILE < rows ? r0 + TILE : rows;                                  \
            for (isize c0 = 0; c0 < cols; c0 += TILE) {                                     \
                isize c1 = c0 + TILE < cols ? c0 + TILE : cols;                              \
                for (isize c = c0; c < c1; c++) {                                            \
                    T *out = dst + c * stride;                                                    \
                    for (isize r = r0; r < r1; r++) out[r] = src[r * sstride + c];              \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }

DEFINE_TRANSPOSE(transpose8, uint8_t)
#ifdef __SSE2__
#include <emmintrin.h>
/* 8x8 blocks of 16-bit elements (BF16, F16) through SSE2 registers: three rounds of unpacks, 16, 32 and 64
 * bits wide. Element by element, a 16-bit transpose ran at a fifth of the 32-bit one's speed on tall bands
 * (0.54 against 2.5 GiB/s on a Llama lm_head strip). */
static inline void block8x8(const uint16_t *s, isize sstride, uint16_t *d, isize stride) {
    __m128i a[8], t[8], u[8];
    for (int k = 0; k < 8; k++) a[k] = _mm_loadu_si128((const __m128i *)(s + k * sstride));
    for (int k = 0; k < 4; k++) {
        t[2 * k] = _mm_unpacklo_epi16(a[2 * k], a[2 * k + 1]);
        t[2 * k + 1] = _mm_unpackhi_epi16(a[2 * k], a[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++) { /* rows 0-3 then 4-7 */
        u[4 * k] = _mm_unpacklo_epi32(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm_unpackhi_epi32(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm_unpacklo_epi32(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm_unpackhi_epi32(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int k = 0; k < 4; k++) {
        _mm_storeu_si128((__m128i *)(d + 2 * k * stride), _mm_unpacklo_epi64(u[k], u[k + 4]));
        _mm_storeu_si128((__m128i *)(d + (2 * k + 1) * stride), _mm_unpackhi_epi64(u[k], u[k + 4]));
    }
}

/* 4x4 blocks of 32-bit elements through SSE2 registers (integer unpacks: the bits are not interpreted). */
static inline void block4x4(const uint32_t *s, isize cols, uint32_t *d, isize stride) { /* cols: source row stride */
    __m128i a = _mm_loadu_si128((const __m128i *)(s));
    __m128i b = _mm_loadu_si128((const __m128i *)(s + cols));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + 2 * cols));
    __m128i e = _mm_loadu_si128((const __m128i *)(s + 3 * cols));
    __m128i ab0 = _mm_unpacklo_epi32(a, b), ab1 = _mm_unpackhi_epi32(a, b);
    __m128i ce0 = _mm_unpacklo_epi32(c, e), ce1 = _mm_unpackhi_epi32(c, e);
    _mm_storeu_si128((__m128i *)(d), _mm_unpacklo_epi64(ab0, ce0));
    _mm_storeu_si128((__m128i *)(d + stride), _mm_unpackhi_epi64(ab0, ce0));
    _mm_storeu_si128((__m128i *)(d + 2 * stride), _mm_unpacklo_epi64(ab1, ce1));
    _mm_storeu_si128((__m128i *)(d + 3 * stride), _mm_unpackhi_epi64(ab1, ce1));
}

/* Tiles walked in B x B register blocks (BLOCK), the edges element by element. */
#define DEFINE_BLOCKED_TRANSPOSE(NAME, T, B, BLOCK)                                                         \
    static void NAME(const T *src, T *dst, isize rows, isize cols, isize sstride, isize stride) {           \
        for (isize r0 = 0; r0 < rows; r0 += TILE) {                                                         \
            isize r1 = r0 + TILE < rows ? r0 + TILE : rows;                                                  \
            for (isize c0 = 0; c0 < cols; c0 += TILE) {                                                     \
                isize c1 = c0 + TILE < cols ? c0 + TILE : cols;                                              \
                if (r1 + TILE <= rows) /* the next tile's rows: rows far apart defeat the hardware's prefetch */ \
                    for (isize k = r1; k < r1 + TILE; k++) {                                                 \
                        __builtin_prefetch(src + k * sstride + c0);                                          \
                        __builtin_prefetch(src + k * sstride + c1 - 1);                                      \
                    }                                                                                        \
                isize r = r0;                                                                                \
                for (; r + B <= r1; r += B) {                                                                \
                    isize c = c0;                                                                            \
                    for (; c + B <= c1; c += B) BLOCK(src + r * sstride + c, sstride, dst + c * stride + r, stride); \
                    for (; c < c1; c++)                                                                      \
                        for (isize k = r; k < r + B; k++) dst[c * stride + k] = src[k * sstride + c];        \
                }                                                                                            \
                for (; r < r1; r++)                                                                          \
                    for (isize c = c0; c < c1; c++) dst[c * stride + r] = src[r * sstride + c];              \
            }                                                                                                \
        }                                                                                                    \
    }

DEFINE_BLOCKED_TRANSPOSE(transpose16, uint16_t, 8, block8x8)
DEFINE_BLOCKED_TRANSPOSE(transpose32, uint32_t, 4, block4x4)
#else
DEFINE_TRANSPOSE(transpose16, uint16_t)
DEFINE_TRANSPOSE(transpose32, uint32_t)
#endif
DEFINE_TRANSPOSE(transpose64, uint64_t)

/* The caller (kernels/compiled.py) has checked the geometry against both buffers. */
EXPORT void syncd_transpose(const void *src, void *dst, isize rows, isize cols, isize itemsize,
                            isize sstride, isize scol, isize stride, isize col) {
    switch (itemsize) {
    case 1: transpose8((const uint8_t *)src + scol, (uint8_t *)dst + col, rows, cols, sstride, stride); break;
    case 2: transpose16((const uint16_t *)src + scol, (uint16_t *)dst + col, rows, cols, sstride, stride); break;
    case 4: transpose32((const uint32_t *)src + scol, (uint32_t *)dst + col, rows, cols, sstride, stride); break;
    case 8: transpose64((const uint64_t *)src + scol, (uint64_t *)dst + col, rows, cols, sstride, stride); break;
    default: break;
    }
}

/* The in-cache check of a transposed block, apart from the transposing code above (a fault in one is not
 * repeated in the other): dst[c, dst_col + r] must equal src[r, src_col + c], compared as bytes. With
 * samples == 0 every element is compared; otherwise `samples` elements of every TILE x TILE tile, each at its
 * own pseudo-random place (splitmix64 from `seed`, which the caller draws afresh for every block). The
 * sampling rule is syncd.engine.write.checks.check_transposed's, the numpy form of this check. */
static inline uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Compared as bytes, through fixed-size copies the compiler turns into one load each (a memcmp call per sampled
 * element was 5% of a Llama conversion's CPU). */
#define SAME_AS(T, a, b) (memcpy(&x, (a), sizeof(T)), memcpy(&y, (b), sizeof(T)), x == y)
static inline int same_element(const char *src, const char *dst, isize r, isize c, isize itemsize,
                               isize sstride, isize stride) {
    const char *a = src + (r * sstride + c) * itemsize, *b = dst + (c * stride + r) * itemsize;
    switch (itemsize) {
    case 1: return a[0] == b[0];
    case 2: { uint16_t x, y; return SAME_AS(uint16_t, a, b); }
    case 4: { uint32_t x, y; return SAME_AS(uint32_t, a, b); }
    case 8: { uint64_t x, y; return SAME_AS(uint64_t, a, b); }
    default: return memcmp(a, b, (size_t)itemsize) == 0;
    }
}

static int matches(const char *src, const char *dst, isize rows, isize cols, isize itemsize,
                   isize sstride, isize stride, isize samples, uint64_t seed) {
    if (samples == 0) {
        for (isize r = 0; r < rows; r++)
            for (isize c = 0; c < cols; c++)
                if (!same_element(src, dst, r, c, itemsize, sstride, stride)) return 0;
        return 1;
    }
    uint64_t state = seed;
    for (isize r0 = 0; r0 < rows; r0 += TILE)
        for (isize c0 = 0; c0 < cols; c0 += TILE)
            for (isize k = 0; k < samples; k++) {
                uint64_t x = splitmix64(&state);
                isize r = r0 + (isize)(x % TILE), c = c0 + (isize)((x >> 32) % TILE);
                if (r >= rows) r = rows - 1; /* short tiles at the edges: the last row or column, as numpy's */
                if (c >= cols) c = cols - 1;
                if (!same_element(src, dst, r, c, itemsize, sstride, stride)) return 0;
            }
    return 1;
}

EXPORT int syncd_check(const void *src, const void *dst, isize rows, isize cols, isize itemsize,
                       isize sstride, isize scol, isize stride, isize col, isize samples,
                       uint64_t seed) {
    return matches((const char *)src + scol * itemsize, (const char *)dst + col * itemsize, rows, cols, itemsize,
                   sstride, stride, samples, seed);
}

/* Every piece whole (pwrite may write less than asked; EINTR is retried): the bytes written, or -1 with errno. */
static long long write_pieces(int fd, const char *buf, isize count, isize segment, long long offset,
                              long long stride) {
    long long total = 0;
    for (isize k = 0; k < count; k++) {
        const char *piece = buf + k * segment;
        isize done = 0;
        while (done < segment) {
            ssize_t n = pwrite(fd, piece + done, (size_t)(segment - done), (off_t)(offset + k * stride + done));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                if (n == 0) errno = EIO;
                return -1;
            }
            done += n;
        }
        total += segment;
    }
    return total;
}

/* The bytes written, or -errno. */
EXPORT long long syncd_pwrite_pieces(int fd, const void *buf, isize count, isize segment, long long offset,
                                     long long stride) {
    long long total = write_pieces(fd, (const char *)buf, count, segment, offset, stride);
    return total < 0 ? -(long long)errno : total;
}

/* Each 4-byte word w_k of a piece, offset by a constant of its place (seed + k * STEP, mod 2^32), is squared
 * exactly (a 64-bit product) and the squares are summed mod 2^64. Distinct words have distinct squares, so a
 * changed word always changes its term, and words that trade places change the sum by 2(a - b)(p - q), which
 * cannot vanish mod 2^64 for 32-bit differences (a plain sum misses a swap, a weighted sum a sign-bit swap).
 * SSE2 squares four words per step (pmuludq), near memory speed. */
#define SUM_STEP 0x9E3779B9u

static uint64_t piece_sum(const char *at, isize words, uint32_t seed) {
    uint64_t sum = 0;
    isize k = 0;
#ifdef __SSE2__
    __m128i place = _mm_add_epi32(_mm_set1_epi32((int)seed),
                                  _mm_setr_epi32(0, (int)SUM_STEP, (int)(2u * SUM_STEP), (int)(3u * SUM_STEP)));
    const __m128i step = _mm_set1_epi32((int)(4u * SUM_STEP));
    __m128i acc = _mm_setzero_si128();
    for (; k + 4 <= words; k += 4) {
        __m128i x = _mm_add_epi32(_mm_loadu_si128((const __m128i *)(at + 4 * k)), place);
        __m128i odd = _mm_srli_epi64(x, 32);
        acc = _mm_add_epi64(acc, _mm_mul_epu32(x, x));
        acc = _mm_add_epi64(acc, _mm_mul_epu32(odd, odd));
        place = _mm_add_epi32(place, step);
    }
    uint64_t lanes[2];
    _mm_storeu_si128((__m128i *)lanes, acc);
    sum = lanes[0] + lanes[1];
#endif
    for (; k < words; k++) {
        uint32_t word;
        memcpy(&word, at + 4 * k, 4);
        uint64_t x = (uint32_t)(word + seed + (uint32_t)k * SUM_STEP);
        sum += x * x;
    }
    return sum;
}

/* Where the pieces go: piece k is row first_row + k of a block of total_rows rows. With chunk >= segment the
 * pieces lie end to end (row r at r * segment); otherwise the block is laid out in bands of `chunk` bytes of
 * every row, each band's rows end to end: byte b of row r, in band j = b / chunk (n bytes wide: chunk, or what
 * is left of the row), goes to j * chunk * total_rows + r * n + b % chunk. A band of columns is then one
 * contiguous matrix, which transposes at three times the speed of the same band read out of rows far apart
 * (each on another page: measured on the lm_head's groups, onepass.py). place() puts bytes at..at+len of a row. */
static void place(char *buf, const char *bytes, isize at, isize len, isize segment, isize chunk, isize row,
                  isize rows) {
    if (chunk >= segment) {
        memcpy(buf + row * segment + at, bytes, (size_t)len);
        return;
    }
    for (isize end = at + len; at < end;) {
        isize j = at / chunk, band_end = (j + 1) * chunk < segment ? (j + 1) * chunk : segment;
        isize n = band_end - j * chunk, m = (band_end < end ? band_end : end) - at;
        memcpy(buf + j * chunk * rows + row * n + (at - j * chunk), bytes, (size_t)m);
        bytes += m;
        at += m;
    }
}

#define STAGING_BYTES (64 << 10) /* a piece placed in bands is read through this much at a time, in cache */

/* Band j of pieces k0..k1 (as place() lays them out): n bytes of each, from byte at of the piece. A fixed n lets
 * the compiler turn each copy into a load and a store; the common band widths get one. */
#define COPY_BAND_ROWS(N)                                                                          \
    for (isize k = k0; k < k1; k++) memcpy(out + (k - k0) * (N), src + k * stride + at, (size_t)(N))
static void copy_band_rows(const char *src, char *out, isize k0, isize k1, isize stride, isize at, isize n) {
    switch (n) {
    case 8: COPY_BAND_ROWS(8); break;
    case 16: COPY_BAND_ROWS(16); break;
    case 32: COPY_BAND_ROWS(32); break;
    case 64: COPY_BAND_ROWS(64); break;
    default: COPY_BAND_ROWS(n); break;
    }
}

#define TILE_ROWS 16 /* pieces placed together: their bands' parts land as runs of TILE_ROWS * chunk bytes */

/* Piece k from src + k * stride, placed as row first_row + k as place() says. In bands, the pieces go a tile of
 * TILE_ROWS at a time, band by band: piece after piece, each cut into every band, scattered a few bytes to each
 * of up to a hundred places a band apart (a Llama lm_head's column group: 3 KiB pieces in bands of 32 bytes),
 * which cost 0.1 s a group of 94 MiB in calls and cache misses; by tiles, each band receives runs of
 * TILE_ROWS pieces' parts, end to end. */
static void place_pieces(const char *src, char *dst, isize count, isize segment, isize stride, isize first_row,
                         isize total_rows, isize chunk) {
    if (chunk >= segment) {
        for (isize k = 0; k < count; k++) memcpy(dst + (first_row + k) * segment, src + k * stride, (size_t)segment);
        return;
    }
    for (isize k0 = 0; k0 < count; k0 += TILE_ROWS) {
        isize k1 = k0 + TILE_ROWS < count ? k0 + TILE_ROWS : count;
        for (isize at = 0; at < segment; at += chunk) {
            isize n = segment - at < chunk ? segment - at : chunk; /* the last band: what is left of the row */
            copy_band_rows(src, dst + at * total_rows + (first_row + k0) * n, k0, k1, stride, at, n);
        }
    }
}

/* len bytes at off into part, EINTR and short reads retried: the bytes read (fewer only at the end of the
 * file), or -errno. */
static long long read_fully(int fd, char *part, isize len, long long off) {
    isize done = 0;
    while (done < len) {
        ssize_t n = pread(fd, part + done, (size_t)(len - done), (off_t)(off + done));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -(long long)errno;
        if (n == 0) break;
        done += n;
    }
    return done;
}

/* Every piece whole, or as much as the file holds (a short count means end of file): the bytes read, or -errno.
 * Pieces are placed as place() says: read straight into place when they lie end to end; in bands, through a
 * staging buffer of at most STAGING_BYTES, as many pieces at a time as it holds (up to a tile, then placed as
 * place_pieces does), or a part of one piece at a time when a piece is longer. Their checksums are taken
 * afterwards, over the bands as placed (onepass.py): what is summed is what is transposed, so a piece placed
 * wrong is caught as well as one read wrong. */
EXPORT long long syncd_pread_pieces(int fd, void *buf, isize count, isize segment, long long offset,
                                    long long stride, isize first_row, isize total_rows, isize chunk) {
    char *out = (char *)buf;
    long long total = 0, n;
    if (chunk >= segment) {
        for (isize k = 0; k < count; k++) {
            if ((n = read_fully(fd, out + (first_row + k) * segment, segment, offset + k * stride)) < 0) return n;
            if ((total += n) < (k + 1) * (long long)segment) break; /* the end of the file */
        }
        return total;
    }
    isize batch = segment <= STAGING_BYTES ? STAGING_BYTES / segment : 1;
    batch = batch < TILE_ROWS ? batch : TILE_ROWS;
    isize step = segment < STAGING_BYTES ? segment : STAGING_BYTES;
    char *staging = malloc((size_t)(batch * step));
    if (!staging) return -(long long)ENOMEM;
    for (isize k0 = 0; k0 < count; k0 += batch) {
        isize k1 = k0 + batch < count ? k0 + batch : count;
        for (isize k = k0; k < k1; k++)
            for (isize at = 0; at < segment; at += step) {
                isize len = segment - at < step ? segment - at : step;
                char *part = staging + (batch > 1 ? (k - k0) * segment : 0);
                if ((n = read_fully(fd, part, len, offset + k * stride + at)) < 0) {
                    free(staging);
                    return n;
                }
                if ((total += n) < k * (long long)segment + at + len) { /* the end of the file */
                    free(staging);
                    return total;
                }
                if (batch == 1) place(out, part, at, len, segment, chunk, first_row + k, total_rows);
            }
        if (batch > 1) place_pieces(staging, out, k1 - k0, segment, segment, first_row + k0, total_rows, chunk);
    }
    free(staging);
    return total;
}

/* pread_pieces from memory: piece k from src + k * stride, placed in dst as place() says. The caller has checked
 * the geometry against both buffers. */
EXPORT void syncd_copy_pieces(const void *src, void *dst, isize count, isize segment, isize stride,
                              isize first_row, isize total_rows, isize chunk) {
    place_pieces((const char *)src, (char *)dst, count, segment, stride, first_row, total_rows, chunk);
}

/* With first_word > 0 the pieces are parts of longer ones, from their word first_word on; with add, each sum is
 * added to what out holds: the sum of a piece is the sum of its parts' (each word's term depends on its place
 * alone), so a piece laid out in bands is summed band by band (onepass.py). */
EXPORT void syncd_piece_sums(const void *buf, isize rows, isize stride, isize row_bytes, isize piece_bytes,
                             uint64_t seed, uint64_t *out, isize out_stride, isize first_word, int add) {
    isize pieces = (row_bytes + piece_bytes - 1) / piece_bytes;
    uint32_t first = (uint32_t)seed + (uint32_t)first_word * SUM_STEP;
    for (isize r = 0; r < rows; r++) {
        const char *row = (const char *)buf + r * stride;
        for (isize p = 0; p < pieces; p++) {
            isize start = p * piece_bytes, end = start + piece_bytes < row_bytes ? start + piece_bytes : row_bytes;
            uint64_t sum = piece_sum(row + start, (end - start) / 4, first);
            out[r * out_stride + p] = add ? out[r * out_stride + p] + sum : sum;
        }
    }
}
