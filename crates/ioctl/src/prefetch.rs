//! A software prefetch hint: asks the CPU to start loading the cache line
//! holding a value, so that a batch of independent memory-latency-bound
//! probes (the fingerprint index's filters) overlaps its cache misses.
//!
//! Invariant: a prefetch never faults and never changes memory or program
//! results (only timing); taking a reference guarantees the address is
//! valid anyway. A no-op on targets other than x86_64.

/// Hints that the cache line holding `*v` will be read soon.
#[inline(always)]
pub fn prefetch_read<T: ?Sized>(v: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = v as *const T as *const i8;
        // SAFETY: SSE is part of the x86_64 baseline, so the instruction
        // exists on every CPU this target runs on; PREFETCHT0 only hints
        // the cache and never faults, and `p` comes from a live reference.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_changes_nothing() {
        let v: Vec<u64> = (0..1024).collect();
        for x in &v {
            prefetch_read(x);
        }
        prefetch_read(&v[..]);
        assert_eq!(v.iter().sum::<u64>(), 1023 * 1024 / 2);
    }
}
