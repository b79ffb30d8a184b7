"""Triton's interpreter (TRITON_INTERPRET=1) without its repeated language patching: speed only, same numbers.

Under the interpreter a kernel launch swaps triton.language's builtins for NumPy-backed ones (`_patch_lang`) and
swaps them back when the grid is done. A @triton.jit helper called from inside a kernel patches them again, for
every program of the grid: a full `inspect.getmembers` walk over triton.language, its tensor class and its math
module, each time. By then the enclosing launch has already patched every builtin, so the walk finds nothing
left to swap, and the scope it returns is dropped unrestored. Here that walk is skipped when the helper's
language modules are already patched (their `load` is no longer a builtin). In tests/test_tp_fused.py's FP8
layer check the walks were 20 s of 52 s (17,632 helper calls).

Second, the interpreter's `_get_np_dtype` builds a 20-entry dict of Triton dtypes (hashing each) on every call, to
look one up: about 114,000 calls and 8% of an interpreted float64 train_single step. Its answer depends on the
dtype alone (a block type's on its element type), so it is looked up once per dtype.

Installed by conftest.py in the test process and preloaded into the workers' fork server (distributed_helper.py).
If a Triton release renames these internals, nothing is patched and the interpreter runs as shipped."""
import inspect
import os


def install():
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or getattr(patch_lang, "skips_patched", False):
        return

    def patched(lang):
        return not tl.core.is_builtin(getattr(lang, "load", None))

    langs_of = {}                             # a jit function's language modules, looked up once

    def patch_lang_once(fn):
        if fn not in langs_of:
            langs_of[fn] = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        langs = langs_of[fn]
        if langs and all(patched(lang) for lang in langs):
            return None                   # a helper inside a running launch: nothing left to patch
        return patch_lang(fn)

    patch_lang_once.skips_patched = True
    interpreter._patch_lang = patch_lang_once
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None:
        interpreter._get_np_dtype = _memoised_np_dtype(np_dtype, tl)


def _memoised_np_dtype(np_dtype, tl):
    """interpreter._get_np_dtype(tt_dtype) once per dtype: a block type's NumPy dtype is its element type's, so
    that is the key (pointers, which are not hashable, are uint64 addresses)."""
    cache = {}

    def lookup(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):
            return np_dtype(key)
        found = cache.get(key)
        if found is None:
            found = cache[key] = np_dtype(key)
        return found
    return lookup


install()
