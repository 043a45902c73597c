//! Which of the extended attributes the store looks up on its own any
//! live inode may hold: `security.capability` (the kernel asks it before
//! every write) and the two POSIX ACLs (asked at every create, `chmod`
//! and ACL-as-mode `setxattr`). A tree without them, the common case,
//! then costs no statement for them: a small file through `cp -a` asked
//! SQLite for its directory's default ACL and dropped an access ACL it
//! never had (bench/notes/store-transport.md, "Updates that change
//! nothing").
//!
//! Invariant: a flag is false only if no live row of `xattrs` has that
//! name. Each is read from the database when it is opened or replaced
//! ([`XattrsSeen::load`]) and set before any statement writes such a
//! row ([`XattrsSeen::saw`]); it is never cleared while the database is
//! open (a removal or a rollback leaves it true, which costs only a
//! statement).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use rusqlite::Connection;

use crate::acl;
use crate::error::Result;
use crate::ns::CAPS;

/// The names followed, in the flags' order.
const NAMES: [&[u8]; 3] = [CAPS, acl::ACCESS, acl::DEFAULT];

/// See the module's doc.
#[derive(Debug, Default)]
pub(crate) struct XattrsSeen([AtomicBool; 3]);

impl XattrsSeen {
    /// The flags as `db` holds them.
    pub(crate) fn load(db: &Connection) -> Result<XattrsSeen> {
        let seen = XattrsSeen::default();
        seen.reload(db)?;
        Ok(seen)
    }

    /// Reads the flags again from `db`, which replaced the database. One
    /// pass: `xattrs` has no index on `name`, and three `EXISTS` scanned
    /// it three times where no inode holds these names (1,000,000
    /// `security.selinux` rows: 0.08-0.13 s against 0.15-0.26 s).
    pub(crate) fn reload(&self, db: &Connection) -> Result<()> {
        let mut st = db.prepare(
            "SELECT COALESCE(MAX(name = ?1), 0), COALESCE(MAX(name = ?2), 0),
                    COALESCE(MAX(name = ?3), 0)
             FROM xattrs WHERE name IN (?1, ?2, ?3)",
        )?;
        let has: [bool; 3] = st.query_row(NAMES, |r| Ok([r.get(0)?, r.get(1)?, r.get(2)?]))?;
        for (flag, has) in self.0.iter().zip(has) {
            flag.store(has, Relaxed);
        }
        Ok(())
    }

    /// False only if no live inode holds `name`; true for a name not
    /// followed.
    pub(crate) fn may_hold(&self, name: &[u8]) -> bool {
        NAMES
            .iter()
            .position(|&n| n == name)
            .is_none_or(|i| self.0[i].load(Relaxed))
    }

    /// To be called before a row of `xattrs` named `name` is written.
    pub(crate) fn saw(&self, name: &[u8]) {
        if let Some(i) = NAMES.iter().position(|&n| n == name) {
            self.0[i].store(true, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_follow_the_rows_and_only_the_names_followed() {
        let db = Connection::open_in_memory().unwrap();
        db.execute_batch("CREATE TABLE xattrs (ino INTEGER, name BLOB, value BLOB)")
            .unwrap();
        let s = XattrsSeen::load(&db).unwrap();
        assert!(!s.may_hold(CAPS) && !s.may_hold(acl::ACCESS) && !s.may_hold(acl::DEFAULT));
        assert!(
            s.may_hold(b"user.other"),
            "a name not followed may be there"
        );
        s.saw(acl::DEFAULT);
        assert!(s.may_hold(acl::DEFAULT) && !s.may_hold(acl::ACCESS));
        db.execute("INSERT INTO xattrs VALUES (5, ?1, x'00')", [CAPS])
            .unwrap();
        s.reload(&db).unwrap();
        assert!(
            s.may_hold(CAPS) && !s.may_hold(acl::DEFAULT),
            "as the rows say"
        );
    }
}
