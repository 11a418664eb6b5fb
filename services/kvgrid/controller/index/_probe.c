/* Compiled hot loops of MemoryIndex (kvgrid/controller/index/memory.py): probing one query's keys,
 * inserting one event's keys and placing rows on a rehash in the open-addressing table, over the same numpy buffers the
 * Python code uses (the table layout is documented there; this file only walks it).
 *
 * Row layout: key (2 words), then TIERS blocks of w mask words (L1, GPU, L2).
 *
 * Invariants: the caller holds the index lock (and the GIL: nothing here releases it), passes the
 * table's current buffers and shape, and made room before an insert (a free row always exists, so
 * every probe chain ends). Keys are 16-byte little-endian (lo, hi) pairs. Little-endian hosts only:
 * the module refuses to import elsewhere and memory.py falls back to its Python loops, which give
 * the same answers (tests/controller/test_memindex.py runs both).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define ST_EMPTY 0
#define ST_FULL 1

static inline uint64_t load_u64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* masks(...) -> one Python int from w native little-endian words */
static PyObject *mask_int(const uint64_t *words, Py_ssize_t w) {
    if (w == 1) return PyLong_FromUnsignedLongLong(words[0]);
    return _PyLong_FromByteArray((const unsigned char *)words, (size_t)(8 * w), 1, 0);
}

typedef struct {
    Py_buffer st, tab, keys;
} bufs_t;

static void release(bufs_t *b) {
    if (b->st.obj) PyBuffer_Release(&b->st);
    if (b->tab.obj) PyBuffer_Release(&b->tab);
    if (b->keys.obj) PyBuffer_Release(&b->keys);
}

/* The table buffers match (stride, shift); ``item`` is the byte width of one element of ``keys``
 * (16 for a key, 8 * stride for place's whole rows). */
static int check_shape(bufs_t *b, Py_ssize_t stride, int shift, Py_ssize_t item) {
    Py_ssize_t cap = b->st.len;
    if (cap <= 0 || (cap & (cap - 1)) || stride < 3 || b->tab.len != cap * stride * 8 || shift < 1 ||
        shift > 63 || ((uint64_t)1 << (64 - shift)) != (uint64_t)cap) {
        PyErr_SetString(PyExc_ValueError, "_probe: buffers do not match the table shape");
        return -1;
    }
    if (b->keys.len % item) {
        PyErr_Format(PyExc_ValueError, "_probe: %zd bytes of keys or rows are not whole items of %zd bytes",
                     b->keys.len, item);
        return -1;
    }
    return 0;
}

/* Mask blocks per row: L1, GPU, L2 words (kvgrid.controller.index.base.NUM_TIERS; IndexTier order). */
#define TIERS 3

/* The row of key (lo, hi), or NULL: one linear probe chain, ending at the key or an empty row. */
static inline const uint64_t *find_row(const uint8_t *st, const uint64_t *tab, Py_ssize_t stride, int shift,
                                       uint64_t mask, uint64_t lo, uint64_t hi) {
    uint64_t i = (lo ^ (hi >> 1)) >> shift;
    for (;;) {
        uint8_t s = st[i];
        if (s == ST_FULL) {
            const uint64_t *r = tab + i * stride;
            if (r[0] == lo && r[1] == hi) return r;
        } else if (s == ST_EMPTY) {
            return NULL;
        }
        i = (i + 1) & mask;
    }
}

/* Request every key's home row before any is read: the cache misses overlap. */
static inline void prefetch_homes(const uint8_t *st, const uint64_t *tab, Py_ssize_t stride, int shift,
                                  const unsigned char *k, Py_ssize_t n, int write) {
    for (Py_ssize_t q = 0; q < n; q++) {
        uint64_t i = (load_u64(k + 16 * q) ^ (load_u64(k + 16 * q + 8) >> 1)) >> shift;
        if (write) {
            __builtin_prefetch(st + i, 1);
            __builtin_prefetch(tab + i * stride, 1);
        } else {
            __builtin_prefetch(st + i);
            __builtin_prefetch(tab + i * stride);
        }
    }
}

/* Parse the (state, tab, stride, shift, w, keys, stop) arguments of probe / probe_words. */
static int probe_args(PyObject *args, bufs_t *b, Py_ssize_t *stride, int *shift, Py_ssize_t *w, int *stop) {
    if (!PyArg_ParseTuple(args, "y*y*nily*p", &b->st, &b->tab, stride, shift, w, &b->keys, stop)) return -1;
    if (check_shape(b, *stride, *shift, 16) < 0) return -1;
    if (*w < 1 || 2 + TIERS * *w > *stride) {
        PyErr_SetString(PyExc_ValueError, "_probe: mask words do not fit the row");
        return -1;
    }
    return 0;
}

/* probe(state, tab, stride, shift, w, keys, stop) -> (l1 list, gpu list, l2 list)
 * Per key the L1, GPU and L2 holder masks (Python ints); with stop, the lists end before the first
 * key that is absent or has empty masks (a prefix cannot continue past it). */
static PyObject *probe(PyObject *Py_UNUSED(self), PyObject *args) {
    bufs_t b = {0};
    Py_ssize_t stride, w;
    int shift, stop;
    PyObject *lists[TIERS] = {NULL}, *out = NULL;
    if (probe_args(args, &b, &stride, &shift, &w, &stop) < 0) goto done;
    const uint8_t *st = b.st.buf;
    const uint64_t *tab = b.tab.buf;
    const unsigned char *k = b.keys.buf;
    const uint64_t mask = (uint64_t)b.st.len - 1;
    const Py_ssize_t n = b.keys.len / 16;
    static const uint64_t zeros[1] = {0};
    for (int t = 0; t < TIERS; t++)
        if (!(lists[t] = PyList_New(0))) goto done;
    prefetch_homes(st, tab, stride, shift, k, n, 0);
    for (Py_ssize_t q = 0; q < n; q++) {
        const uint64_t *row = find_row(st, tab, stride, shift, mask, load_u64(k + 16 * q), load_u64(k + 16 * q + 8));
        int empty = 1;
        for (Py_ssize_t x = 0; row && x < TIERS * w; x++) {
            if (row[2 + x]) {
                empty = 0;
                break;
            }
        }
        if (empty && stop) break;
        for (int t = 0; t < TIERS; t++) {
            PyObject *m = row ? mask_int(row + 2 + t * w, w) : mask_int(zeros, 1);
            if (!m || PyList_Append(lists[t], m) < 0) {
                Py_XDECREF(m);
                goto done;
            }
            Py_DECREF(m);
        }
    }
    out = PyTuple_Pack(TIERS, lists[0], lists[1], lists[2]);
done:
    for (int t = 0; t < TIERS; t++) Py_XDECREF(lists[t]);
    release(&b);
    return out;
}

/* insert(state, tab, stride, shift, off, bit, keys) -> (new rows, rows taken from empty, bits set)
 * Sets ``bit`` in word ``off`` of every key's row, inserting absent keys (the first tombstone on a
 * chain is reused, as MemoryIndex.add does). */
static PyObject *insert(PyObject *Py_UNUSED(self), PyObject *args) {
    bufs_t b = {0};
    Py_ssize_t stride, off;
    int shift;
    unsigned long long bit;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "w*w*ninKy*", &b.st, &b.tab, &stride, &shift, &off, &bit, &b.keys))
        return NULL;
    if (check_shape(&b, stride, shift, 16) < 0) goto done;
    if (off < 2 || off >= stride) {
        PyErr_SetString(PyExc_ValueError, "_probe: word offset outside the row");
        goto done;
    }
    uint8_t *st = b.st.buf;
    uint64_t *tab = b.tab.buf;
    const unsigned char *k = b.keys.buf;
    const uint64_t mask = (uint64_t)b.st.len - 1;
    const Py_ssize_t n = b.keys.len / 16;
    Py_ssize_t added = 0, fresh = 0, used = 0;
    prefetch_homes(st, tab, stride, shift, k, n, 1);
    for (Py_ssize_t q = 0; q < n; q++) {
        uint64_t lo = load_u64(k + 16 * q), hi = load_u64(k + 16 * q + 8);
        uint64_t i = (lo ^ (hi >> 1)) >> shift;
        int64_t tomb = -1;
        uint8_t s;
        for (;;) {
            s = st[i];
            if (s == ST_FULL) {
                if (tab[i * stride] == lo && tab[i * stride + 1] == hi) break;
            } else if (s == ST_EMPTY) {
                break;
            } else if (tomb < 0) {
                tomb = (int64_t)i;
            }
            i = (i + 1) & mask;
        }
        uint64_t *r;
        if (s != ST_FULL) {
            if (tomb >= 0)
                i = (uint64_t)tomb;
            else
                used++;
            st[i] = ST_FULL;
            r = tab + i * stride;
            memset(r + 2, 0, 8 * (size_t)(stride - 2)); /* a reused tombstone keeps zero masks */
            r[0] = lo;
            r[1] = hi;
            fresh++;
        } else {
            r = tab + i * stride;
        }
        if (!(r[off] & bit)) {
            r[off] |= bit;
            added++;
        }
    }
    out = Py_BuildValue("nnn", fresh, used, added);
done:
    release(&b);
    return out;
}


/* probe_words(state, tab, stride, shift, w, keys, stop) -> bytes
 * As probe, but the masks as raw rows: per key TIERS * w native uint64 words (L1 words, then GPU
 * words, then L2 words), zeros where absent; with stop, the rows end before the first key with no
 * holder. */
static PyObject *probe_words(PyObject *Py_UNUSED(self), PyObject *args) {
    bufs_t b = {0};
    Py_ssize_t stride, w;
    int shift, stop;
    PyObject *out = NULL;
    if (probe_args(args, &b, &stride, &shift, &w, &stop) < 0) goto done;
    const uint8_t *st = b.st.buf;
    const uint64_t *tab = b.tab.buf;
    const unsigned char *k = b.keys.buf;
    const uint64_t mask = (uint64_t)b.st.len - 1;
    const Py_ssize_t n = b.keys.len / 16, rw = TIERS * w;
    prefetch_homes(st, tab, stride, shift, k, n, 0);
    out = PyBytes_FromStringAndSize(NULL, n * 8 * rw);
    if (!out) goto done;
    uint64_t *dst = (uint64_t *)PyBytes_AS_STRING(out);
    Py_ssize_t rows = 0;
    for (Py_ssize_t q = 0; q < n; q++) {
        const uint64_t *row = find_row(st, tab, stride, shift, mask, load_u64(k + 16 * q), load_u64(k + 16 * q + 8));
        uint64_t *d = dst + rows * rw, any = 0;
        for (Py_ssize_t x = 0; x < rw; x++) any |= d[x] = row ? row[2 + x] : 0;
        if (!any && stop) break;
        rows++;
    }
    if (rows < n) _PyBytes_Resize(&out, rows * 8 * rw);
done:
    release(&b);
    return out;
}

typedef struct {
    int64_t slot, matched, gpu, l1, l2, gen; /* gen: position in slot order */
} entry_t;

#define SAME_KEY(a, b) ((a).matched == (b).matched && (a).gpu == (b).gpu && (a).l1 == (b).l1 && (a).l2 == (b).l2)

static int by_rank(const void *a, const void *b) {
    const entry_t *x = a, *y = b;
    if (x->matched != y->matched) return x->matched > y->matched ? -1 : 1;
    if (x->gpu != y->gpu) return x->gpu > y->gpu ? -1 : 1;
    if (x->l1 != y->l1) return x->l1 > y->l1 ? -1 : 1;
    if (x->l2 != y->l2) return x->l2 > y->l2 ? -1 : 1;
    return x->slot < y->slot ? -1 : (x->slot > y->slot);
}

#define HAS(words, s) (((words)[(s) >> 6] >> ((s) & 63)) & 1)

/* match_words(words, w, eligible, max_pods) -> bytes of int64
 * One query's match from probe_words' rows (see kvgrid.controller.matching.match_one for the
 * rules): per listed pod, longest first, then more GPU, more own L1, more own L2, lower slot. The
 * result is [pods ascending (k), pod_index (k), gpu (k), l1 (k), l2 (k), peer (k), 0, k,
 * peer_fetchable]. Rows are grouped into runs of identical masks first, so the work is runs x pods. */
static PyObject *match_words(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer wb = {0}, eb = {0};
    Py_ssize_t w, max_pods;
    PyObject *out = NULL;
    entry_t *ent = NULL;
    Py_ssize_t *run_start = NULL;
    int64_t *pods = NULL;
    entry_t *rk = NULL;
    if (!PyArg_ParseTuple(args, "y*ny*n", &wb, &w, &eb, &max_pods)) return NULL;
    if (w < 1 || wb.len % (8 * TIERS * w) || eb.len != 8 * w) {
        PyErr_SetString(PyExc_ValueError, "_probe.match_words: buffers do not match the word count");
        goto done;
    }
    const uint64_t *rows = wb.buf, *elig = eb.buf;
    const Py_ssize_t n = wb.len / (8 * TIERS * w), ns = 64 * w, rw = TIERS * w;
    Py_ssize_t pf = n, nruns = 0;
    run_start = PyMem_Malloc((n + 1) * sizeof(Py_ssize_t));
    ent = PyMem_Malloc((ns ? ns : 1) * sizeof(entry_t));
    pods = PyMem_Malloc((ns ? ns : 1) * sizeof(int64_t));
    rk = PyMem_Malloc((ns ? ns : 1) * sizeof(entry_t));
    if (!run_start || !ent || !pods || !rk) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint64_t *r = rows + i * rw;
        if (pf == n) {
            uint64_t l1any = 0;
            for (Py_ssize_t x = 0; x < w; x++) l1any |= r[x];
            if (!l1any) pf = i;
        }
        if (i == 0 || memcmp(r, r - rw, 8 * rw)) run_start[nruns++] = i;
    }
    run_start[nruns] = n;
    Py_ssize_t k = 0;
    for (Py_ssize_t s = 0; s < ns; s++) {
        if (!HAS(elig, s)) continue;
        int64_t matched = 0, gc = 0, lc = 0, dc = 0;
        for (Py_ssize_t r = 0; r < nruns; r++) {
            const uint64_t *row = rows + run_start[r] * rw;
            int64_t len = run_start[r + 1] - run_start[r];
            if (HAS(row + w, s)) {
                gc += len;
            } else if (HAS(row, s)) {
                lc += len;
            } else if (HAS(row + 2 * w, s)) {
                dc += len;
            } else {
                uint64_t l1any = 0;
                for (Py_ssize_t x = 0; x < w; x++) l1any |= row[x];
                if (!l1any) break; /* nobody can fetch it: the prefix ends */
            }
            matched += len;
        }
        if (gc || lc || dc) {
            ent[k] = (entry_t){s, matched, gc, lc, dc, k};
            k++;
        }
    }
    /* Rank order. Entries were made in slot order; the distinct (matched, gpu, l1, l2) keys are few
     * (a conversation's pods share a handful of histories), so the keys are sorted and each key's
     * entries copied out in slot order; past 32 distinct keys qsort gives the same order. */
    entry_t keys[32];
    Py_ssize_t nk = 0, r = 0;
    for (Py_ssize_t j = 0; j < k && nk <= 32; j++) {
        Py_ssize_t x = 0;
        while (x < nk && !SAME_KEY(keys[x], ent[j])) x++;
        if (x == nk) {
            if (nk == 32) nk = 33; /* too many: qsort */
            else keys[nk++] = ent[j];
        }
    }
    if (nk <= 32) {
        qsort(keys, nk, sizeof(entry_t), by_rank);
        for (Py_ssize_t x = 0; x < nk; x++)
            for (Py_ssize_t j = 0; j < k; j++)
                if (SAME_KEY(keys[x], ent[j])) rk[r++] = ent[j];
    } else {
        memcpy(rk, ent, k * sizeof(entry_t));
        qsort(rk, k, sizeof(entry_t), by_rank);
    }
    Py_ssize_t kept = (max_pods > 0 && k > max_pods) ? max_pods : k;
    out = PyBytes_FromStringAndSize(NULL, (6 * kept + 3) * 8);
    if (!out) goto done;
    int64_t *o = (int64_t *)PyBytes_AS_STRING(out);
    /* pods: the kept slots ascending (= their order in ent); pod_index: position among them */
    for (Py_ssize_t j = 0; j < k; j++) pods[j] = -1;
    for (Py_ssize_t j = 0; j < kept; j++) pods[rk[j].gen] = 0;
    Py_ssize_t np_ = 0;
    for (Py_ssize_t j = 0; j < k; j++)
        if (pods[j] == 0) {
            o[np_] = ent[j].slot;
            pods[j] = np_++;
        }
    for (Py_ssize_t j = 0; j < kept; j++) {
        o[kept + j] = pods[rk[j].gen];
        o[2 * kept + j] = rk[j].gpu;
        o[3 * kept + j] = rk[j].l1;
        o[4 * kept + j] = rk[j].l2;
        o[5 * kept + j] = rk[j].matched - rk[j].gpu - rk[j].l1 - rk[j].l2;
    }
    k = kept;
    o[6 * k] = 0;
    o[6 * k + 1] = k;
    o[6 * k + 2] = pf;
done:
    PyMem_Free(run_start);
    PyMem_Free(ent);
    PyMem_Free(pods);
    PyMem_Free(rk);
    PyBuffer_Release(&wb);
    PyBuffer_Release(&eb);
    return out;
}

/* place(state, tab, stride, shift, rows) -> None
 * Insert whole rows (``rows``: [m, stride] uint64, keys distinct and absent) into a table without
 * tombstones (a rehash): each at the first empty row of its chain. */
static PyObject *place(PyObject *Py_UNUSED(self), PyObject *args) {
    bufs_t b = {0};
    Py_ssize_t stride;
    int shift;
    PyObject *out = NULL;
    if (!PyArg_ParseTuple(args, "w*w*niy*", &b.st, &b.tab, &stride, &shift, &b.keys)) return NULL;
    if (check_shape(&b, stride, shift, 8 * stride) < 0) goto done;
    uint8_t *st = b.st.buf;
    uint64_t *tab = b.tab.buf;
    const uint64_t *rows = b.keys.buf, mask = (uint64_t)b.st.len - 1;
    const Py_ssize_t m = b.keys.len / (8 * stride);
    for (Py_ssize_t r = 0; r < m; r++) {
        const uint64_t *row = rows + r * stride;
        uint64_t i = (row[0] ^ (row[1] >> 1)) >> shift;
        while (st[i] != ST_EMPTY) i = (i + 1) & mask;
        st[i] = ST_FULL;
        memcpy(tab + i * stride, row, 8 * (size_t)stride);
    }
    out = Py_None;
    Py_INCREF(out);
done:
    release(&b);
    return out;
}

static PyMethodDef methods[] = {
    {"probe", probe, METH_VARARGS, "Holder masks of one query's keys (see the module comment)."},
    {"insert", insert, METH_VARARGS, "Set one holder bit on one event's keys, inserting absent ones."},
    {"place", place, METH_VARARGS, "Insert whole rows into a table without tombstones (rehash)."},
    {"probe_words", probe_words, METH_VARARGS, "One query's mask rows as bytes (see above)."},
    {"match_words", match_words, METH_VARARGS, "One query's match from its mask rows (see above)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_probe", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__probe(void) {
#if !PY_LITTLE_ENDIAN
    PyErr_SetString(PyExc_ImportError, "_probe: little-endian hosts only");
    return NULL;
#else
    return PyModule_Create(&module);
#endif
}
