/* Cache-blocked transpose of a row-major matrix of 1, 2, 4 or 8-byte elements, bit for bit.
 *
 * Elements are moved as unsigned integers of their width, never as floats, so every bit pattern
 * (signalling NaNs included) arrives unchanged. The matrix is walked in TILE x TILE tiles so that both the
 * rows read and the rows written stay in L1 while a tile is moved. The GIL is released for the copy: the
 * caller may run several transposes on several threads.
 *
 * transpose(src, dst, rows, cols, itemsize, src_stride, src_col, dst_stride, dst_col):
 * dst[c, dst_col + r] = src[r, src_col + c] for r < rows, c < cols, rows of src src_stride elements apart and
 * rows of dst dst_stride apart: a band of columns of a larger matrix can be transposed without copying it out.
 * check(src, dst, ..., samples, seed) (same geometry): the in-cache check of a transposed block, in C so that a
 * transposing conversion never needs numpy (its import and its per-block calls cost 0.25 s of CPU per GiB).
 * pwrite_pieces(fd, buf, count, segment, offset, stride): the `count` pieces of `segment` bytes of buf, laid end to
 * end, written at offset, offset + stride, ...: the output-row pieces of a tensor transposed in strips, in one call
 * without the GIL instead of one Python call per piece.
 * Built by setup.py as an optional extension; syncd.engine.write.kernels falls back to numpy (identical bytes, the same
 * check) when it is absent.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define TILE 32

#define DEFINE_TRANSPOSE(NAME, T)                                                               \
    static void NAME(const T *src, T *dst, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t sstride, Py_ssize_t stride) { \
        for (Py_ssize_t r0 = 0; r0 < rows; r0 += TILE) {                                         \
            Py_ssize_t r1 = r0 + TILE < rows ? r0 + TILE : rows;                                  \
            for (Py_ssize_t c0 = 0; c0 < cols; c0 += TILE) {                                     \
                Py_ssize_t c1 = c0 + TILE < cols ? c0 + TILE : cols;                              \
                for (Py_ssize_t c = c0; c < c1; c++) {                                            \
                    T *out = dst + c * stride;                                                    \
                    for (Py_ssize_t r = r0; r < r1; r++) out[r] = src[r * sstride + c];              \
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
static inline void block8x8(const uint16_t *s, Py_ssize_t sstride, uint16_t *d, Py_ssize_t stride) {
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

static void transpose16(const uint16_t *src, uint16_t *dst, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t sstride,
                        Py_ssize_t stride) {
    for (Py_ssize_t r0 = 0; r0 < rows; r0 += TILE) {
        Py_ssize_t r1 = r0 + TILE < rows ? r0 + TILE : rows;
        for (Py_ssize_t c0 = 0; c0 < cols; c0 += TILE) {
            Py_ssize_t c1 = c0 + TILE < cols ? c0 + TILE : cols;
            Py_ssize_t r = r0;
            for (; r + 8 <= r1; r += 8) {
                Py_ssize_t c = c0;
                for (; c + 8 <= c1; c += 8) block8x8(src + r * sstride + c, sstride, dst + c * stride + r, stride);
                for (; c < c1; c++)
                    for (Py_ssize_t k = r; k < r + 8; k++) dst[c * stride + k] = src[k * sstride + c];
            }
            for (; r < r1; r++)
                for (Py_ssize_t c = c0; c < c1; c++) dst[c * stride + r] = src[r * sstride + c];
        }
    }
}

/* 4x4 blocks of 32-bit elements through SSE2 registers (integer unpacks: the bits are not interpreted). */
static inline void block4x4(const uint32_t *s, Py_ssize_t cols, uint32_t *d, Py_ssize_t stride) { /* cols: source row stride */
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

static void transpose32(const uint32_t *src, uint32_t *dst, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t sstride,
                        Py_ssize_t stride) {
    for (Py_ssize_t r0 = 0; r0 < rows; r0 += TILE) {
        Py_ssize_t r1 = r0 + TILE < rows ? r0 + TILE : rows;
        for (Py_ssize_t c0 = 0; c0 < cols; c0 += TILE) {
            Py_ssize_t c1 = c0 + TILE < cols ? c0 + TILE : cols;
            Py_ssize_t r = r0;
            for (; r + 4 <= r1; r += 4) {
                Py_ssize_t c = c0;
                for (; c + 4 <= c1; c += 4) block4x4(src + r * sstride + c, sstride, dst + c * stride + r, stride);
                for (; c < c1; c++)
                    for (Py_ssize_t k = r; k < r + 4; k++) dst[c * stride + k] = src[k * sstride + c];
            }
            for (; r < r1; r++)
                for (Py_ssize_t c = c0; c < c1; c++) dst[c * stride + r] = src[r * sstride + c];
        }
    }
}
#else
DEFINE_TRANSPOSE(transpose16, uint16_t)
DEFINE_TRANSPOSE(transpose32, uint32_t)
#endif
DEFINE_TRANSPOSE(transpose64, uint64_t)

/* Both entry points take the same geometry; 0 with a ValueError set if the buffers cannot hold it. */
static int geometry_ok(const Py_buffer *src, const Py_buffer *dst, Py_ssize_t rows, Py_ssize_t cols,
                       Py_ssize_t itemsize, Py_ssize_t sstride, Py_ssize_t scol, Py_ssize_t stride, Py_ssize_t col) {
    Py_ssize_t selems = src->len / (itemsize > 0 ? itemsize : 1), delems = dst->len / (itemsize > 0 ? itemsize : 1);
    if (rows < 0 || cols < 0 || scol < 0 || col < 0 || sstride < cols + scol || stride < rows + col ||
        !(itemsize == 1 || itemsize == 2 || itemsize == 4 || itemsize == 8)) {
        PyErr_SetString(PyExc_ValueError, "bad transpose geometry");
        return 0;
    }
    if (rows && cols && (selems / sstride < rows - 1 || (rows - 1) * sstride + scol + cols > selems ||
                         delems / stride < cols - 1 || (cols - 1) * stride + col + rows > delems)) {
        PyErr_SetString(PyExc_ValueError, "buffers too small for the transpose");
        return 0;
    }
    return 1;
}

static PyObject *py_transpose(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t rows, cols, itemsize, sstride, scol, stride, col;
    if (!PyArg_ParseTuple(args, "y*w*nnnnnnn", &src, &dst, &rows, &cols, &itemsize, &sstride, &scol, &stride, &col))
        return NULL;
    PyObject *result = NULL;
    if (!geometry_ok(&src, &dst, rows, cols, itemsize, sstride, scol, stride, col)) {
        /* ValueError set */
    } else if ((uintptr_t)src.buf % itemsize || (uintptr_t)dst.buf % itemsize) {
        PyErr_SetString(PyExc_ValueError, "buffers not aligned to the element size");
    } else {
        Py_BEGIN_ALLOW_THREADS
        switch (itemsize) {
        case 1: transpose8((const uint8_t *)src.buf + scol, (uint8_t *)dst.buf + col, rows, cols, sstride, stride); break;
        case 2: transpose16((const uint16_t *)src.buf + scol, (uint16_t *)dst.buf + col, rows, cols, sstride, stride); break;
        case 4: transpose32((const uint32_t *)src.buf + scol, (uint32_t *)dst.buf + col, rows, cols, sstride, stride); break;
        default: transpose64((const uint64_t *)src.buf + scol, (uint64_t *)dst.buf + col, rows, cols, sstride, stride); break;
        }
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
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

static int same_element(const char *src, const char *dst, Py_ssize_t r, Py_ssize_t c, Py_ssize_t itemsize,
                        Py_ssize_t sstride, Py_ssize_t stride) {
    return memcmp(src + (r * sstride + c) * itemsize, dst + (c * stride + r) * itemsize, (size_t)itemsize) == 0;
}

static int matches(const char *src, const char *dst, Py_ssize_t rows, Py_ssize_t cols, Py_ssize_t itemsize,
                   Py_ssize_t sstride, Py_ssize_t stride, Py_ssize_t samples, uint64_t seed) {
    if (samples == 0) {
        for (Py_ssize_t r = 0; r < rows; r++)
            for (Py_ssize_t c = 0; c < cols; c++)
                if (!same_element(src, dst, r, c, itemsize, sstride, stride)) return 0;
        return 1;
    }
    uint64_t state = seed;
    for (Py_ssize_t r0 = 0; r0 < rows; r0 += TILE)
        for (Py_ssize_t c0 = 0; c0 < cols; c0 += TILE)
            for (Py_ssize_t k = 0; k < samples; k++) {
                uint64_t x = splitmix64(&state);
                Py_ssize_t r = r0 + (Py_ssize_t)(x % TILE), c = c0 + (Py_ssize_t)((x >> 32) % TILE);
                if (r >= rows) r = rows - 1; /* short tiles at the edges: the last row or column, as numpy's */
                if (c >= cols) c = cols - 1;
                if (!same_element(src, dst, r, c, itemsize, sstride, stride)) return 0;
            }
    return 1;
}

static PyObject *py_check(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    Py_ssize_t rows, cols, itemsize, sstride, scol, stride, col, samples;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "y*y*nnnnnnnnK", &src, &dst, &rows, &cols, &itemsize, &sstride, &scol, &stride,
                          &col, &samples, &seed))
        return NULL;
    PyObject *result = NULL;
    if (geometry_ok(&src, &dst, rows, cols, itemsize, sstride, scol, stride, col) && samples >= 0) {
        int ok;
        Py_BEGIN_ALLOW_THREADS
        ok = matches((const char *)src.buf + scol * itemsize, (const char *)dst.buf + col * itemsize, rows, cols,
                     itemsize, sstride, stride, samples, (uint64_t)seed);
        Py_END_ALLOW_THREADS
        result = PyBool_FromLong(ok);
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "bad check geometry");
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

/* Every piece whole (pwrite may write less than asked; EINTR is retried): the bytes written, or -1 with errno. */
static long long write_pieces(int fd, const char *buf, Py_ssize_t count, Py_ssize_t segment, long long offset,
                              long long stride) {
    long long total = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        const char *piece = buf + k * segment;
        Py_ssize_t done = 0;
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

static PyObject *py_pwrite_pieces(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer buf;
    Py_ssize_t count, segment;
    long long offset, stride;
    if (!PyArg_ParseTuple(args, "iy*nnLL", &fd, &buf, &count, &segment, &offset, &stride)) return NULL;
    PyObject *result = NULL;
    if (count < 0 || segment < 0 || offset < 0 || stride < 0 || (count && segment > buf.len / count)) {
        PyErr_SetString(PyExc_ValueError, "bad pieces geometry");
    } else {
        long long total;
        Py_BEGIN_ALLOW_THREADS
        total = write_pieces(fd, (const char *)buf.buf, count, segment, offset, stride);
        Py_END_ALLOW_THREADS
        result = total < 0 ? PyErr_SetFromErrno(PyExc_OSError) : PyLong_FromLongLong(total);
    }
    PyBuffer_Release(&buf);
    return result;
}

static PyMethodDef methods[] = {
    {"transpose", py_transpose, METH_VARARGS, "dst[c, col + r] = src[r, scol + c], bit for bit (GIL released)"},
    {"check", py_check, METH_VARARGS,
     "True if dst[c, col + r] == src[r, scol + c] at every element (samples 0) or at `samples` per tile"},
    {"pwrite_pieces", py_pwrite_pieces, METH_VARARGS,
     "write count pieces of segment bytes of buf at offset + k * stride (GIL released); the bytes written"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_transpose", NULL, -1, methods};

PyMODINIT_FUNC PyInit__transpose(void) { return PyModule_Create(&module); }
