//! `f32` values whose first one sits on a 64-byte boundary: the storage of the vectors an
//! index scores.
//!
//! Why: the dot-product kernels load 64 bytes at a time (AVX-512). A `Vec<f32>` is only
//! 16-byte aligned (malloc's; Rust promises 4), and where its buffer lands depends on what
//! the process allocated before. With rows of 384 floats (1,536 bytes, a multiple of 64) a
//! matrix that starts off a cache line has every load of every row straddle two lines: `host
//! index build` (matrix at 48 mod 64) built HNSW on 30k × 384 vectors in 11.0-11.7 s, in 9.1-10.0 s aligned, alternating
//! (docs/BENCHMARKS.md, "HNSW build"), and one benchmark binary, aligned by chance, had read
//! as 1.5× faster than `host` on the same code.

use std::ops::{Deref, DerefMut};

/// One cache line of values.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// A fixed-length `[f32]` on cache-line boundaries.
pub struct AlignedVec {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedVec {
    /// `len` zeros.
    pub fn zeroed(len: usize) -> Self {
        Self { lines: vec![Line([0.0; 16]); len.div_ceil(16)], len }
    }

    /// A copy of `values`.
    pub fn from_slice(values: &[f32]) -> Self {
        let mut v = Self::zeroed(values.len());
        v.copy_from_slice(values);
        v
    }
}

impl Deref for AlignedVec {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // Safety: `lines` holds at least `len` initialised f32s, contiguous (`repr(C)` arrays,
        // no padding: 16 × 4 bytes = the 64-byte alignment).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const f32, self.len) }
    }
}

impl DerefMut for AlignedVec {
    fn deref_mut(&mut self) -> &mut [f32] {
        // Safety: as in `deref`, and `&mut self` makes the view unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut f32, self.len) }
    }
}

impl From<&[f32]> for AlignedVec {
    fn from(values: &[f32]) -> Self {
        Self::from_slice(values)
    }
}

impl From<Vec<f32>> for AlignedVec {
    /// A copy: a `Vec`'s buffer cannot be realigned in place.
    fn from(values: Vec<f32>) -> Self {
        Self::from_slice(&values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_cache_line_and_holds_exactly_its_values() {
        for len in [0, 1, 15, 16, 17, 384 * 3 + 5] {
            let values: Vec<f32> = (0..len).map(|i| i as f32 * 0.5).collect();
            let mut v = AlignedVec::from_slice(&values);
            assert_eq!(v.len(), len);
            assert_eq!(&v[..], &values[..]);
            if len > 0 {
                assert_eq!(v.as_ptr() as usize % 64, 0);
                v[len - 1] = -1.0;
                assert_eq!(v[len - 1], -1.0);
            }
        }
        assert!(AlignedVec::zeroed(1000).iter().all(|&x| x == 0.0));
    }
}
