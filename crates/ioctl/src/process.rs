//! Process settings: the C allocator's arenas, and the I/O scheduling
//! priority (`ioprio_set(2)`, `ioprio_get(2)`; glibc has no wrappers). A
//! process in the idle class gets disk time only when no other process
//! asks for it; children inherit the class.

use std::io;

const IOPRIO_WHO_PROCESS: libc::c_long = 1;
const IOPRIO_CLASS_SHIFT: u32 = 13;

/// `IOPRIO_CLASS_*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoClass {
    None,
    RealTime,
    BestEffort,
    Idle,
}

/// Puts the calling thread's process (pid 0: itself) in the idle class.
pub fn set_idle_io_priority() -> io::Result<()> {
    let value = 3 << IOPRIO_CLASS_SHIFT;
    // SAFETY: ioprio_set takes three integers and touches no memory of ours.
    let r = unsafe { libc::syscall(libc::SYS_ioprio_set, IOPRIO_WHO_PROCESS, 0, value) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The I/O class of process `pid` (0: the caller).
pub fn io_class(pid: u32) -> io::Result<IoClass> {
    // SAFETY: ioprio_get takes two integers and touches no memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_ioprio_get,
            IOPRIO_WHO_PROCESS,
            pid as libc::c_long,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(match (r as u32) >> IOPRIO_CLASS_SHIFT {
        1 => IoClass::RealTime,
        2 => IoClass::BestEffort,
        3 => IoClass::Idle,
        _ => IoClass::None,
    })
}

/// Caps the C allocator's arenas (glibc `mallopt(M_ARENA_MAX)`). Without
/// a cap each thread that allocates while others do may get an arena of
/// its own (up to 8 per core), and memory freed in one arena is reused
/// only by the threads on it: a multi-threaded daemon then holds far more
/// than it uses. Whether the cap was set (false where the C library is
/// not glibc).
pub fn limit_malloc_arenas(n: u32) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt takes two integers and only changes the
        // allocator's parameters for arenas made later.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, n.max(1) as libc::c_int) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = n;
        false
    }
}

/// Fixes the size from which the C allocator gives a block pages of its
/// own, returned to the kernel when the block is freed (glibc
/// `mallopt(M_MMAP_THRESHOLD)`). Left alone, glibc raises that threshold
/// (up to 32 MiB) each time such a block is freed, after which freed
/// large buffers stay in the heap, resident. Whether it was set (false
/// where the C library is not glibc).
pub fn fix_mmap_threshold(bytes: usize) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let n = bytes.min(libc::c_int::MAX as usize) as libc::c_int;
        // SAFETY: mallopt takes two integers and only changes the
        // allocator's parameters.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, n) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = bytes;
        false
    }
}

/// Gives the allocator's free pages (in every arena) back to the kernel
/// (glibc `malloc_trim(0)`); a no-op elsewhere.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes a size and only returns free pages.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn arenas_can_be_capped_and_memory_released() {
        assert_eq!(
            super::limit_malloc_arenas(2),
            cfg!(all(target_os = "linux", target_env = "gnu"))
        );
        let v: Vec<Vec<u8>> = (0..64).map(|_| vec![1u8; 1 << 16]).collect();
        drop(v);
        super::release_free_memory();
    }

    #[test]
    fn mmap_threshold_can_be_fixed() {
        assert_eq!(
            super::fix_mmap_threshold(128 << 10),
            cfg!(all(target_os = "linux", target_env = "gnu"))
        );
    }
}
