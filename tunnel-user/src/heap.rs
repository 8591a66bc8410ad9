//! The process's allocator: mimalloc, entered through its plain `mi_malloc` family when a
//! plain block already has the alignment Rust asks for.
//!
//! The `mimalloc` crate sends every allocation through `mi_malloc_aligned`, which in
//! mimalloc v3 takes a slow, general path for any block over 1 KiB or whose rounded size
//! is not a power of two, and sometimes over-allocates for it. Rust's own `System`
//! allocator makes the same choice as this one against `malloc` (docs/design.md,
//! performance knob 16).

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

/// The alignment every mimalloc block of at least this size has (`MI_MAX_ALIGN_SIZE`
/// on 64-bit targets), as C's `malloc` must give any object (`max_align_t`).
const PLAIN_ALIGN: usize = 16;

/// mimalloc as the global allocator (`#[global_allocator]` in `main.rs`).
pub struct Mimalloc;

/// Whether a plain block of `size` bytes is aligned enough for `align`: it is aligned to
/// `PLAIN_ALIGN`, or to its size's own alignment when smaller, and Rust sizes are
/// multiples of their alignment.
fn plain(size: usize, align: usize) -> bool {
    align <= PLAIN_ALIGN && align <= size
}

/// A block for `layout` from mimalloc's plain `call` when a plain block is aligned
/// enough, from its `aligned` counterpart otherwise (`mi_malloc` or `mi_zalloc` and
/// theirs). Inlined, so both calls are direct.
///
/// # Safety
/// `call` and `aligned` are a mimalloc allocation function and its aligned form.
#[inline]
unsafe fn allocate(
    layout: Layout,
    call: unsafe extern "C" fn(usize) -> *mut c_void,
    aligned: unsafe extern "C" fn(usize, usize) -> *mut c_void,
) -> *mut u8 {
    // SAFETY: plain C calls (the caller's contract); a null return is the allocation
    // failure Rust expects.
    let block = unsafe {
        if plain(layout.size(), layout.align()) {
            call(layout.size())
        } else {
            aligned(layout.size(), layout.align())
        }
    };
    block.cast()
}

// SAFETY: every pointer handed out comes from mimalloc, with at least the layout's size
// and alignment (the `plain` rule above, or mimalloc's aligned calls otherwise), and is
// given back to it with `mi_free` or `mi_realloc*`, which accept any block mimalloc made.
unsafe impl GlobalAlloc for Mimalloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: mimalloc's allocation function and its aligned form.
        unsafe { allocate(layout, mi::mi_malloc, mi::mi_malloc_aligned) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: mimalloc's zeroing allocation function and its aligned form.
        unsafe { allocate(layout, mi::mi_zalloc, mi::mi_zalloc_aligned) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from this allocator (the caller's contract).
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator with `layout`; the new block keeps the
        // alignment by the same rule as `alloc`.
        unsafe {
            if plain(new_size, layout.align()) {
                mi::mi_realloc(ptr.cast(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast(), new_size, layout.align()).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes up to 64 KiB at alignments up to 64 bytes, through both the plain and the
    /// aligned calls, come back aligned, zeroed when asked, writable and reallocatable.
    #[test]
    fn blocks_have_the_alignment_asked_for() {
        let heap = Mimalloc;
        for align in [1, 2, 4, 8, 16, 32, 64] {
            let mut size = align;
            while size <= 64 * 1024 {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: the layouts are non-zero; each block is freed once, by us.
                unsafe {
                    for zeroed in [false, true] {
                        let p = if zeroed {
                            heap.alloc_zeroed(layout)
                        } else {
                            heap.alloc(layout)
                        };
                        assert!(!p.is_null(), "{layout:?}");
                        assert_eq!(p as usize % align, 0, "{layout:?} zeroed={zeroed}");
                        if zeroed {
                            assert!(std::slice::from_raw_parts(p, size).iter().all(|b| *b == 0));
                        }
                        p.write_bytes(0xa5, size);
                        let grown = heap.realloc(p, layout, size * 3);
                        assert_eq!(grown as usize % align, 0, "{layout:?} grown");
                        assert_eq!(*grown.add(size - 1), 0xa5, "{layout:?} kept its bytes");
                        heap.dealloc(grown, Layout::from_size_align(size * 3, align).unwrap());
                    }
                }
                size = if size < 256 {
                    size + align
                } else {
                    size * 2 + align
                };
            }
        }
    }
}
