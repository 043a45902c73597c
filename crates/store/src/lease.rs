//! The writer's lease: one cache writes a remote store at a time.
//!
//! The `lease` object names the cache that writes the store and until
//! when. A cache takes it at open, when it is free, expired or its own,
//! by a swap from the version it read; renews it at every push; gives it
//! back at close. A second cache is refused while the lease holds
//! (`store init --recover --force` takes it anyway: the user says the old
//! machine is gone). Fencing does not rest on the lease (clocks differ):
//! the manifest's swap is the commit point, and a cache whose manifest
//! swap or lease renewal finds another's version stops writing.

use std::time::Duration;

use onecopy_objects::{ObjectError, Objects, Tag};
use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};

/// Key of the lease.
pub const LEASE: &str = "lease";
/// How long a lease holds without renewal, at least.
pub const TTL_MIN: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The holding cache's writer id.
    pub writer: String,
    /// Its machine's name (for the message of a refusal).
    pub host: String,
    /// Until when it holds, ns since the epoch; 0: given back.
    pub expires_ns: i64,
    /// Random: every version differs (a swap compares versions, and two
    /// renewals within a clock tick would otherwise be the same bytes).
    #[serde(default)]
    pub nonce: String,
}

fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

fn read(objects: &dyn Objects) -> Result<Option<(Lease, Tag)>> {
    match objects.get(LEASE) {
        Ok((bytes, tag)) => {
            let l = serde_json::from_slice(&bytes).map_err(|e| StoreError::Remote {
                why: format!("the bucket's lease is not readable: {e}"),
            })?;
            Ok(Some((l, tag)))
        }
        Err(ObjectError::NotFound { .. }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn write(objects: &dyn Objects, l: &Lease, expected: Option<&Tag>) -> Result<Tag> {
    let bytes = serde_json::to_vec_pretty(l).expect("serializes");
    match objects.swap_settled(LEASE, bytes.into(), expected) {
        Ok(tag) => Ok(tag),
        Err(ObjectError::Conflict { .. }) => Err(StoreError::Fenced {
            why: "another cache took the store's lease: this one no longer writes to the \
                  bucket"
                .into(),
        }),
        Err(e) => Err(e.into()),
    }
}

/// Takes the lease for `writer` for `ttl`: refused while another cache
/// holds it, unless `force`.
pub(crate) fn acquire(
    objects: &dyn Objects,
    writer: &str,
    ttl: Duration,
    force: bool,
) -> Result<Tag> {
    let now = crate::store::time_now();
    let held = read(objects)?;
    if let Some((l, _)) = &held {
        if l.writer != writer && l.expires_ns > now && !force {
            let left = Duration::from_nanos((l.expires_ns - now) as u64);
            return Err(StoreError::Fenced {
                why: format!(
                    "the store is in use by another cache (on {}, lease held for {} s more); \
                     if that machine is gone, recover with --force",
                    if l.host.is_empty() { "?" } else { &l.host },
                    left.as_secs() + 1
                ),
            });
        }
    }
    let mine = Lease {
        writer: writer.to_string(),
        host: host(),
        expires_ns: now + ttl.as_nanos() as i64,
        nonce: crate::mirror::random_hex(),
    };
    write(objects, &mine, held.as_ref().map(|(_, t)| t))
}

/// Renews the lease this cache holds (version `tag`). A lease whose tag
/// moved but that still names `writer` is this cache's own: a renewal
/// whose answer was lost took effect (the writer fenced itself for the
/// rest of the mount, and kept the lease past its unmount).
pub(crate) fn renew(objects: &dyn Objects, writer: &str, tag: &Tag, ttl: Duration) -> Result<Tag> {
    let mine = Lease {
        writer: writer.to_string(),
        host: host(),
        expires_ns: crate::store::time_now() + ttl.as_nanos() as i64,
        nonce: crate::mirror::random_hex(),
    };
    match write(objects, &mine, Some(tag)) {
        Err(fenced @ StoreError::Fenced { .. }) => match read(objects)? {
            Some((l, now)) if l.writer == writer => write(objects, &mine, Some(&now)),
            _ => Err(fenced),
        },
        r => r,
    }
}

/// Gives the lease back (best effort: an expiry does the same).
pub(crate) fn release(objects: &dyn Objects, writer: &str, tag: &Tag) {
    let free = Lease {
        writer: writer.to_string(),
        host: host(),
        expires_ns: 0,
        nonce: crate::mirror::random_hex(),
    };
    let _ = write(objects, &free, Some(tag));
}

#[cfg(test)]
mod tests {
    use super::*;
    use onecopy_objects::LocalObjects;

    #[test]
    fn one_holder_at_a_time() {
        let d = tempfile::tempdir().unwrap();
        let o = LocalObjects::new(d.path()).unwrap();
        let ttl = Duration::from_secs(60);
        let a = acquire(&o, "a", ttl, false).unwrap();
        let e = acquire(&o, "b", ttl, false).unwrap_err();
        assert!(e.to_string().contains("in use by another cache"), "{e}");
        let a = renew(&o, "a", &a, ttl).unwrap();
        // A renewal whose answer was lost: the lease moved on, still "a"'s.
        let _lost = renew(&o, "a", &a, ttl).unwrap();
        let a2 = renew(&o, "a", &a, ttl).unwrap();
        release(&o, "a", &a2);
        let b = acquire(&o, "b", ttl, false).unwrap();
        assert!(matches!(
            renew(&o, "a", &a2, ttl),
            Err(StoreError::Fenced { .. })
        ));
        acquire(&o, "c", ttl, true).unwrap();
        assert!(matches!(
            renew(&o, "b", &b, ttl),
            Err(StoreError::Fenced { .. })
        ));
    }

    /// Eight caches racing for a free lease: exactly one gets it.
    #[test]
    fn of_racing_caches_one_wins() {
        let d = tempfile::tempdir().unwrap();
        let o = std::sync::Arc::new(LocalObjects::new(d.path()).unwrap());
        let go = std::sync::Arc::new(std::sync::Barrier::new(8));
        let wins: usize = (0..8)
            .map(|i| {
                let (o, go) = (o.clone(), go.clone());
                std::thread::spawn(move || {
                    go.wait();
                    acquire(&*o, &format!("w{i}"), Duration::from_secs(60), false).is_ok()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap() as usize)
            .sum();
        assert_eq!(wins, 1);
    }

    #[test]
    fn an_expired_lease_is_taken() {
        let d = tempfile::tempdir().unwrap();
        let o = LocalObjects::new(d.path()).unwrap();
        acquire(&o, "a", Duration::from_millis(1), false).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        acquire(&o, "b", Duration::from_secs(60), false).unwrap();
    }
}
