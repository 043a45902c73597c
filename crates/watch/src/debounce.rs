//! When to dedupe: after the last change has been quiet for `settle` (so a
//! file being written in several opens is read once, complete), but no
//! later than `max_delay` after the first change of a batch (so a steady
//! stream of writes does not postpone dedupe forever).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct Debounce {
    settle: Duration,
    max_delay: Duration,
    first: Option<Instant>,
    last: Option<Instant>,
    paths: BTreeSet<PathBuf>,
    unknown: bool,
}

/// The changes gathered since the previous batch.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// Files known to have been written and closed.
    pub paths: BTreeSet<PathBuf>,
    /// Something changed that no path names (poll tick, lost events):
    /// every root must be looked at.
    pub unknown: bool,
    /// When the first change of the batch was seen.
    pub since: Option<Instant>,
}

impl Debounce {
    pub fn new(settle: Duration, max_delay: Duration) -> Debounce {
        Debounce {
            settle,
            max_delay: max_delay.max(settle),
            first: None,
            last: None,
            paths: BTreeSet::new(),
            unknown: false,
        }
    }

    /// Records a change: a written file, or `None` for an unnamed one.
    pub fn touch(&mut self, path: Option<PathBuf>, now: Instant) {
        self.first.get_or_insert(now);
        self.last = Some(now);
        match path {
            Some(p) => {
                self.paths.insert(p);
            }
            None => self.unknown = true,
        }
    }

    /// Whether a batch is waiting.
    pub fn pending(&self) -> bool {
        self.first.is_some()
    }

    /// Whether the pending batch should be deduped now.
    pub fn due(&self, now: Instant) -> bool {
        match (self.first, self.last) {
            (Some(f), Some(l)) => {
                now.duration_since(l) >= self.settle || now.duration_since(f) >= self.max_delay
            }
            _ => false,
        }
    }

    /// Takes the pending batch, leaving the debouncer empty.
    pub fn take(&mut self) -> Batch {
        let b = Batch {
            paths: std::mem::take(&mut self.paths),
            unknown: self.unknown,
            since: self.first,
        };
        self.first = None;
        self.last = None;
        self.unknown = false;
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(2);

    #[test]
    fn waits_for_quiet() {
        let t0 = Instant::now();
        let mut d = Debounce::new(S, Duration::from_secs(30));
        assert!(!d.due(t0) && !d.pending());
        d.touch(Some("/a".into()), t0);
        assert!(!d.due(t0 + Duration::from_secs(1)));
        d.touch(Some("/a".into()), t0 + Duration::from_secs(1));
        assert!(!d.due(t0 + Duration::from_millis(2900)));
        assert!(d.due(t0 + Duration::from_secs(3)));
        let b = d.take();
        assert_eq!(b.paths.len(), 1);
        assert_eq!(b.since, Some(t0));
        assert!(!b.unknown && !d.pending());
    }

    #[test]
    fn a_steady_stream_is_cut_at_max_delay() {
        let t0 = Instant::now();
        let mut d = Debounce::new(S, Duration::from_secs(10));
        for i in 0..20 {
            d.touch(Some(format!("/f{i}").into()), t0 + Duration::from_secs(i));
            if i < 10 {
                assert!(!d.due(t0 + Duration::from_secs(i)), "{i}");
            }
        }
        assert!(d.due(t0 + Duration::from_secs(10)));
    }

    #[test]
    fn unnamed_changes_mark_the_batch() {
        let t0 = Instant::now();
        let mut d = Debounce::new(S, S);
        d.touch(None, t0);
        let b = d.take();
        assert!(b.unknown && b.paths.is_empty());
    }
}
