/* async_ckpt._native: the byte-shuffle filter applied before zstd.
 *
 * shuffle() gathers byte p of every item into plane p, so the compressible
 * sign/exponent bytes of floats sit together and the incompressible mantissa
 * bytes sit apart; unshuffle() undoes it. numpy's strided copies do this at
 * 0.2-3 GB/s; these loops run near memory bandwidth (bench/bench_filters.py).
 * Uses only the CPython C API and the buffer protocol.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define MAX_ITEMSIZE 16

/* Items per tile, both measured best: a shuffle_const tile (at most 16 * 64
 * bytes) stays in L1; the byte-at-a-time generic loops run ~2x faster with
 * 16-item tiles than with 64. */
#define TILE 64
#define GENERIC_TILE 16

/* The *_const loops are only fast once inlined with a constant itemsize. */
#ifdef Py_ALWAYS_INLINE /* CPython >= 3.11 */
#define ALWAYS_INLINE Py_ALWAYS_INLINE
#else
#define ALWAYS_INLINE
#endif

/* Transposes a tile into a local buffer, then writes each plane as one run.
 * The buffer cannot alias dst, so the gather vectorises; writing k byte
 * streams straight into dst does not (at k = 8, 16: 2.3 and 0.6 GB/s against
 * 13 and 7.5 GB/s in cache). */
static inline ALWAYS_INLINE void
shuffle_const(const uint8_t *restrict src, uint8_t *restrict dst, size_t m, size_t k)
{
    uint8_t planes[MAX_ITEMSIZE][TILE];
    size_t i = 0;

    for (; i + TILE <= m; i += TILE) {
        const uint8_t *s = src + i * k;
        for (size_t j = 0; j < TILE; j++) {
            for (size_t p = 0; p < k; p++) {
                planes[p][j] = s[j * k + p];
            }
        }
        for (size_t p = 0; p < k; p++) {
            memcpy(dst + p * m + i, planes[p], TILE);
        }
    }
    for (; i < m; i++) {
        for (size_t p = 0; p < k; p++) {
            dst[p * m + i] = src[i * k + p];
        }
    }
}

/* Reads k sequential plane streams and writes whole items: the inner loop
 * unrolls and -O3 vectorises the interleaving stores. */
static inline ALWAYS_INLINE void
unshuffle_const(const uint8_t *restrict src, uint8_t *restrict dst, size_t m, size_t k)
{
    for (size_t i = 0; i < m; i++) {
        for (size_t p = 0; p < k; p++) {
            dst[i * k + p] = src[p * m + i];
        }
    }
}

/* Any itemsize: a tiled transpose, so the strided side of the copy stays in
 * cache instead of touching a new line for every byte. */
static void
shuffle_tiled(const uint8_t *restrict src, uint8_t *restrict dst, size_t m, size_t k)
{
    for (size_t i0 = 0; i0 < m; i0 += GENERIC_TILE) {
        size_t len = m - i0 < GENERIC_TILE ? m - i0 : GENERIC_TILE;
        for (size_t p = 0; p < k; p++) {
            const uint8_t *s = src + i0 * k + p;
            uint8_t *d = dst + p * m + i0;
            for (size_t i = 0; i < len; i++) {
                d[i] = s[i * k];
            }
        }
    }
}

static void
unshuffle_tiled(const uint8_t *restrict src, uint8_t *restrict dst, size_t m, size_t k)
{
    for (size_t i0 = 0; i0 < m; i0 += GENERIC_TILE) {
        size_t len = m - i0 < GENERIC_TILE ? m - i0 : GENERIC_TILE;
        for (size_t p = 0; p < k; p++) {
            const uint8_t *s = src + p * m + i0;
            uint8_t *d = dst + i0 * k + p;
            for (size_t i = 0; i < len; i++) {
                d[i * k] = s[i];
            }
        }
    }
}

/* Itemsizes of real dtypes get a specialised loop; the rest take the tiled one. */
static void
shuffle_bytes(const uint8_t *src, uint8_t *dst, size_t m, size_t k)
{
    switch (k) {
    case 1: memcpy(dst, src, m); break;
    case 2: shuffle_const(src, dst, m, 2); break;
    case 4: shuffle_const(src, dst, m, 4); break;
    case 8: shuffle_const(src, dst, m, 8); break;
    case 16: shuffle_const(src, dst, m, 16); break;
    default: shuffle_tiled(src, dst, m, k); break;
    }
}

static void
unshuffle_bytes(const uint8_t *src, uint8_t *dst, size_t m, size_t k)
{
    switch (k) {
    case 1: memcpy(dst, src, m); break;
    case 2: unshuffle_const(src, dst, m, 2); break;
    case 4: unshuffle_const(src, dst, m, 4); break;
    case 8: unshuffle_const(src, dst, m, 8); break;
    case 16: unshuffle_const(src, dst, m, 16); break;
    default: unshuffle_tiled(src, dst, m, k); break;
    }
}

typedef void (*filter_fn)(const uint8_t *, uint8_t *, size_t, size_t);

/* Parses (src, itemsize, dst), validates, and runs `filter` without the GIL. */
static PyObject *
run_filter(PyObject *args, const char *format, filter_fn filter)
{
    Py_buffer src, dst;
    Py_ssize_t itemsize;

    if (!PyArg_ParseTuple(args, format, &src, &itemsize, &dst)) {
        return NULL;
    }
    if (itemsize < 1 || itemsize > MAX_ITEMSIZE) {
        PyErr_Format(PyExc_ValueError, "itemsize must be in 1..%d, got %zd",
                     MAX_ITEMSIZE, itemsize);
        goto fail;
    }
    if (src.len % itemsize != 0) {
        PyErr_Format(PyExc_ValueError,
                     "src length %zd is not a multiple of itemsize %zd",
                     src.len, itemsize);
        goto fail;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError,
                     "dst length %zd differs from src length %zd",
                     dst.len, src.len);
        goto fail;
    }

    Py_BEGIN_ALLOW_THREADS
    filter((const uint8_t *)src.buf, (uint8_t *)dst.buf,
           (size_t)(src.len / itemsize), (size_t)itemsize);
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;

fail:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return NULL;
}

static PyObject *
native_shuffle(PyObject *module, PyObject *args)
{
    (void)module;
    return run_filter(args, "y*nw*:shuffle", shuffle_bytes);
}

static PyObject *
native_unshuffle(PyObject *module, PyObject *args)
{
    (void)module;
    return run_filter(args, "y*nw*:unshuffle", unshuffle_bytes);
}

PyDoc_STRVAR(shuffle_doc,
"shuffle($module, src, itemsize, dst, /)\n--\n\n"
"Write the byte planes of src into dst: dst[p*m + i] = src[i*itemsize + p].\n"
"src and dst are contiguous buffers of the same length, a multiple of\n"
"itemsize (1..16); they must not overlap.");

PyDoc_STRVAR(unshuffle_doc,
"unshuffle($module, src, itemsize, dst, /)\n--\n\n"
"Inverse of shuffle: dst[i*itemsize + p] = src[p*m + i].\n"
"src and dst are contiguous buffers of the same length, a multiple of\n"
"itemsize (1..16); they must not overlap.");

static PyMethodDef native_methods[] = {
    {"shuffle", native_shuffle, METH_VARARGS, shuffle_doc},
    {"unshuffle", native_unshuffle, METH_VARARGS, unshuffle_doc},
    {NULL, NULL, 0, NULL},
};

/* The module holds no state, so it is safe in subinterpreters and without a GIL. */
static PyModuleDef_Slot native_slots[] = {
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "async_ckpt._native",
    .m_doc = "Byte-shuffle filter for float tensors (see async_ckpt.filters).",
    .m_size = 0,
    .m_methods = native_methods,
    .m_slots = native_slots,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
