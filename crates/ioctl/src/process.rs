//! The I/O scheduling priority of a process (`ioprio_set(2)`,
//! `ioprio_get(2)`; glibc has no wrappers). A process in the idle class
//! gets disk time only when no other process asks for it; children inherit
//! the class.

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
