//! Dot product, with an AVX2+FMA path picked at run time (the release
//! build targets baseline x86-64, so the compiler alone would stop at SSE2).

pub(crate) type Kernel = fn(&[f32], &[f32]) -> f32;
/// One query against four vectors at once: the query is loaded once per step and the four
/// independent streams keep more loads in flight than four separate calls.
pub(crate) type Kernel4 = fn(&[f32], [&[f32]; 4]) -> [f32; 4];

pub(crate) fn dot_kernel() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return |a, b| unsafe { x86::dot(a, b) };
    }
    dot_scalar
}

pub(crate) fn dot4_kernel() -> Kernel4 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return |q, v| unsafe { x86::dot4(q, v) };
    }
    |q, v| v.map(|x| dot_scalar(q, x))
}

/// `out[i] = <q, row rows[i] of data>`, four rows at a time.
pub(crate) fn dot_many(dot: Kernel, dot4: Kernel4, q: &[f32], data: &[f32], dim: usize, rows: &[u32], out: &mut Vec<f32>) {
    out.clear();
    let row = |r: u32| &data[r as usize * dim..(r as usize + 1) * dim];
    // Start fetching every vector before scoring any (hnswlib prefetches one ahead).
    for &r in rows {
        prefetch_first_line(row(r));
    }
    let mut groups = rows.chunks_exact(4);
    for g in groups.by_ref() {
        out.extend_from_slice(&dot4(q, [row(g[0]), row(g[1]), row(g[2]), row(g[3])]));
    }
    out.extend(groups.remainder().iter().map(|&r| dot(q, row(r))));
}

#[inline]
fn prefetch_first_line(v: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    // Safety: a prefetch is a hint; it never faults, and the pointer is in bounds anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch(v.as_ptr() as *const i8, std::arch::x86_64::_MM_HINT_T0)
    };
}

fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + ra.iter().zip(rb).map(|(x, y)| x * y).sum::<f32>()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// Safety: the caller checked AVX2 and FMA; every `v[i]` is at least as long as `q`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4(q: &[f32], v: [&[f32]; 4]) -> [f32; 4] {
        let n = q.len();
        assert!(v.iter().all(|x| x.len() >= n));
        let pq = q.as_ptr();
        let p = v.map(|x| x.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_loadu_ps(pq.add(i));
            for j in 0..4 {
                acc[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(p[j].add(i)), acc[j]);
            }
            i += 8;
        }
        let mut s = [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])];
        while i < n {
            for j in 0..4 {
                s[j] += *pq.add(i) * *p[j].add(i);
            }
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let (mut a0, mut a1, mut a2, mut a3) = (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 32 <= n {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 16)), _mm256_loadu_ps(pb.add(i + 16)), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 24)), _mm256_loadu_ps(pb.add(i + 24)), a3);
            i += 32;
        }
        while i + 8 <= n {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), a0);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        while i < n {
            s += *pa.add(i) * *pb.add(i);
            i += 1;
        }
        s
    }
}
