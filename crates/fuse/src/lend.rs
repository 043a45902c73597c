//! A ring entry's buffer lent to a thread of the blocking pool, so that a
//! big `WRITE`'s bytes are read, and a big `READ`'s written, where they
//! lie, with no copy on the ring's worker: that copy was a quarter of the
//! mount's CPU in a duplicate write over io_uring, and it ran on the one
//! worker of a CPU (bench/notes/store-transport.md, "Ring buffers lent to
//! the pool").
//!
//! Invariant (what makes the `unsafe` sound): the borrowed buffer
//! outlives every use of it by the pool. [`Lender`] is kept in the
//! borrowing request's future, and borrows the buffer as long as it
//! lives; its `Drop` waits until the pool's closure has finished with
//! the buffer, or has been dropped without running. A future that
//! completes finds it finished; one dropped while the pool still works
//! (the session cancelled) blocks its worker until then, so the ring
//! cannot reuse or free the buffer under the pool. A `Lender` that is
//! never dropped (`mem::forget`) would end the borrow without waiting,
//! which is why lending is `unsafe`: the caller promises to drop it.

use std::marker::PhantomData;
use std::sync::{Arc, Condvar, Mutex};

/// Whether the pool is done with a lent buffer.
#[derive(Default)]
struct Returned {
    done: Mutex<bool>,
    cv: Condvar,
}

/// Kept by the request that lent its buffer, which stays borrowed while
/// it lives: dropping it waits for [`Loan`] to be dropped.
pub(crate) struct Lender<'a>(Arc<Returned>, PhantomData<&'a mut [u8]>);

impl Drop for Lender<'_> {
    fn drop(&mut self) {
        let mut done = self.0.done.lock().unwrap_or_else(|e| e.into_inner());
        while !*done {
            done = self.0.cv.wait(done).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A lent buffer, for one closure on the pool; dropping it (the closure
/// ran, panicked, or never ran) gives the buffer back.
pub(crate) struct Loan {
    ptr: *mut u8,
    len: usize,
    /// Lent by [`lend_mut`]: the only loans [`Loan::bytes_mut`] serves.
    writable: bool,
    back: Arc<Returned>,
}

// SAFETY: the buffer is used by one thread at a time: the lender does not
// touch it until the loan is dropped (see the module's invariant).
unsafe impl Send for Loan {}

impl Drop for Loan {
    fn drop(&mut self) {
        *self.back.done.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.back.cv.notify_all();
    }
}

impl Loan {
    /// The buffer, to read from.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` was a live slice when lent, and stays
        // borrowed by the lender until this loan is dropped.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The buffer, to write into. Panics for a buffer lent with [`lend`]
    /// (shared: writing it would be undefined behaviour).
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        assert!(self.writable, "a buffer lent for reading written");
        // SAFETY: as in `bytes`; `lend_mut` took it from a `&mut` slice
        // the lender no longer touches.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Lends `buf` for reading.
///
/// # Safety
/// The [`Lender`] must be dropped, not leaked (`mem::forget`, a cycle):
/// its drop is what keeps `buf` alive until the [`Loan`] is done.
pub(crate) unsafe fn lend(buf: &[u8]) -> (Lender<'_>, Loan) {
    pair(buf.as_ptr().cast_mut(), buf.len(), false)
}

/// Lends `buf` for writing.
///
/// # Safety
/// As for [`lend`].
pub(crate) unsafe fn lend_mut(buf: &mut [u8]) -> (Lender<'_>, Loan) {
    pair(buf.as_mut_ptr(), buf.len(), true)
}

fn pair<'a>(ptr: *mut u8, len: usize, writable: bool) -> (Lender<'a>, Loan) {
    let back = Arc::new(Returned::default());
    let loan = Loan {
        ptr,
        len,
        writable,
        back: back.clone(),
    };
    (Lender(back, PhantomData), loan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[test]
    fn dropping_the_lender_waits_for_the_loan() {
        let mut buf = vec![0u8; 16];
        let finished = AtomicBool::new(false);
        std::thread::scope(|s| {
            // SAFETY: the lender is dropped below.
            let (lender, mut loan) = unsafe { lend_mut(&mut buf) };
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(200));
                loan.bytes_mut().fill(7);
                finished.store(true, Ordering::SeqCst);
                drop(loan);
            });
            drop(lender);
            assert!(finished.load(Ordering::SeqCst), "lender returned early");
        });
        assert_eq!(buf, vec![7u8; 16]);
    }

    /// Whether dropping `lender` (on another thread) returns within a
    /// second; `then` runs after that second either way.
    fn returns(lender: Lender<'_>, then: impl FnOnce()) -> bool {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(move || {
                drop(lender);
                let _ = tx.send(());
            });
            let r = rx.recv_timeout(Duration::from_secs(1)).is_ok();
            then();
            r
        })
    }

    #[test]
    fn a_loan_dropped_unused_or_in_a_panic_returns_the_buffer() {
        let buf = [1u8, 2, 3];
        // SAFETY (each lend): every lender is dropped in `returns`.
        let (lender, loan) = unsafe { lend(&buf) };
        drop(loan);
        assert!(returns(lender, || ()));
        let (lender, loan) = unsafe { lend(&buf) };
        let r = std::thread::scope(|s| {
            s.spawn(move || {
                assert_eq!(loan.bytes(), &[1, 2, 3]);
                panic!("on the pool");
            })
            .join()
        });
        assert!(r.is_err());
        assert!(returns(lender, || ()));
        let (lender, loan) = unsafe { lend(&buf) };
        assert!(
            !returns(lender, || drop(loan)),
            "returned while the loan was out"
        );
    }

    #[test]
    #[should_panic(expected = "lent for reading")]
    fn a_buffer_lent_for_reading_is_not_written() {
        let buf = [0u8; 4];
        // SAFETY: the lender is dropped at the end of the test.
        let (_lender, mut loan) = unsafe { lend(&buf) };
        loan.bytes_mut()[0] = 1;
    }
}
