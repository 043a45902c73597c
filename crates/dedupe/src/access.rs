//! Who may dedupe into a file: the kernel shares extents into a file opened
//! read-only only for CAP_SYS_ADMIN, the file's owner, or a user with write
//! permission on it (`allow_file_dedupe` in fs/remap_range.c). Any other
//! file the user can read is a source only: planning it as a destination
//! would only earn EPERM.

use std::path::Path;

use rustix::fs::{accessat, stat, Access, AtFlags, CWD};
use rustix::io::Errno;
use rustix::process::geteuid;

/// Whether this process may dedupe into the file at `path`. When the file
/// can not be examined (gone, path too long) the answer is yes: the
/// executor then finds out and reports it as it always did.
pub fn may_dedupe_into(path: &Path) -> bool {
    let euid = geteuid();
    if euid.is_root() {
        return true;
    }
    let owner = match stat(path) {
        Ok(st) => st.st_uid == euid.as_raw(),
        Err(_) => return true,
    };
    decide(owner, || {
        accessat(CWD, path, Access::WRITE_OK, AtFlags::EACCESS)
    })
}

/// The rule for a non-root user: the owner may; others need write
/// permission. A read-only mount (EROFS) is not this rule's business
/// (reported separately); nor is an unexpected error.
fn decide(owner: bool, write_check: impl FnOnce() -> Result<(), Errno>) -> bool {
    if owner {
        return true;
    }
    match write_check() {
        Ok(()) => true,
        Err(Errno::ACCESS | Errno::PERM) => false,
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_or_writer_may() {
        assert!(decide(true, || Err(Errno::ACCESS)));
        assert!(decide(false, || Ok(())));
        assert!(!decide(false, || Err(Errno::ACCESS)));
        assert!(!decide(false, || Err(Errno::PERM)));
        assert!(decide(false, || Err(Errno::ROFS)));
    }

    #[test]
    fn readable_files_of_this_user_qualify() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        std::fs::write(&p, b"x").unwrap();
        assert!(may_dedupe_into(&p));
        assert!(may_dedupe_into(&d.path().join("gone")));
    }
}
