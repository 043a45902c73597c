//! POSIX ACLs in their xattr form, as the kernel hands them over (the
//! `system.posix_acl_access` and `system.posix_acl_default` values:
//! version 2, then 8-byte entries of tag, permissions and id).
//!
//! The mount negotiates FUSE_POSIX_ACL, so the kernel enforces ACLs on
//! every permission check (it reads them with GETXATTR and caches them);
//! what a filesystem must do itself is kept here, as a disk filesystem
//! does it: a new node inherits its directory's default ACL (which then
//! takes the place of the umask), `chmod` rewrites the access ACL, and
//! setting an access ACL sets the mode bits it implies.

/// Xattr names of the two ACLs.
pub(crate) const ACCESS: &[u8] = b"system.posix_acl_access";
pub(crate) const DEFAULT: &[u8] = b"system.posix_acl_default";

/// Whether the store keeps an xattr of this name: any but a `system.*`
/// one other than the two POSIX ACLs. The kernel leaves `system.*`
/// permissions to the filesystem (a FUSE one passes every other name on),
/// and the store gives those names no meaning: setting one is
/// EOPNOTSUPP, as on ext4 and tmpfs, for every caller.
pub(crate) fn keeps_xattr(name: &[u8]) -> bool {
    !name.starts_with(b"system.") || name == ACCESS || name == DEFAULT
}

const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const GROUP: u16 = 0x08;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;

/// A parsed ACL. Invariant: entries as the kernel sent them (it checks
/// order and completeness before a set reaches the filesystem).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Acl(Vec<(u16, u16, u32)>);

impl Acl {
    /// Parses an xattr value; `None` if it is not a version-2 ACL with
    /// known tags.
    pub fn parse(v: &[u8]) -> Option<Acl> {
        if v.len() < 4 || !(v.len() - 4).is_multiple_of(8) || v[..4] != [2, 0, 0, 0] {
            return None;
        }
        let mut entries = Vec::with_capacity((v.len() - 4) / 8);
        for e in v[4..].chunks(8) {
            let tag = u16::from_le_bytes([e[0], e[1]]);
            let perm = u16::from_le_bytes([e[2], e[3]]) & 7;
            let id = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
            if ![USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER].contains(&tag) {
                return None;
            }
            entries.push((tag, perm, id));
        }
        Some(Acl(entries))
    }

    /// The xattr value.
    pub fn to_xattr(&self) -> Vec<u8> {
        let mut v = vec![2, 0, 0, 0];
        for &(tag, perm, id) in &self.0 {
            v.extend_from_slice(&tag.to_le_bytes());
            v.extend_from_slice(&perm.to_le_bytes());
            v.extend_from_slice(&id.to_le_bytes());
        }
        v
    }

    /// The permission bits (0o777) the ACL implies, and whether it says
    /// no more than they do (then it is not kept: the mode is the ACL).
    pub fn mode(&self) -> (u32, bool) {
        let (mut user, mut group, mut mask, mut other, mut minimal) = (0, 0, None, 0, true);
        for &(tag, perm, _) in &self.0 {
            let perm = u32::from(perm);
            match tag {
                USER_OBJ => user = perm,
                GROUP_OBJ => group = perm,
                MASK => mask = Some(perm),
                OTHER => other = perm,
                _ => minimal = false,
            }
        }
        let group = mask.unwrap_or(group);
        (user << 6 | group << 3 | other, minimal && mask.is_none())
    }

    /// A new node's access ACL from its directory's default ACL (the
    /// kernel's `posix_acl_create_masq`): the requested `mode` (no umask)
    /// limits the owner, mask (or group) and other entries, and they in
    /// turn limit the mode, which is returned with its set-id and sticky
    /// bits kept.
    pub fn create_masq(&mut self, mode: u32) -> u32 {
        let mut m = mode & 0o777;
        let (mut group_obj, mut mask) = (None, None);
        for (i, e) in self.0.iter_mut().enumerate() {
            match e.0 {
                USER_OBJ => {
                    e.1 &= ((m >> 6) & 7) as u16;
                    m &= (u32::from(e.1) << 6) | !0o700;
                }
                OTHER => {
                    e.1 &= (m & 7) as u16;
                    m &= u32::from(e.1) | !0o007;
                }
                GROUP_OBJ => group_obj = Some(i),
                MASK => mask = Some(i),
                _ => {}
            }
        }
        if let Some(i) = mask.or(group_obj) {
            let e = &mut self.0[i];
            e.1 &= ((m >> 3) & 7) as u16;
            m &= (u32::from(e.1) << 3) | !0o070;
        }
        (mode & !0o777) | (m & 0o777)
    }

    /// `chmod` to `mode` (the kernel's `posix_acl_chmod`): the owner,
    /// mask (or group) and other entries take the new bits; named users
    /// and groups stay.
    pub fn chmod(&mut self, mode: u32) {
        let has_mask = self.0.iter().any(|e| e.0 == MASK);
        for e in &mut self.0 {
            match e.0 {
                USER_OBJ => e.1 = ((mode >> 6) & 7) as u16,
                OTHER => e.1 = (mode & 7) as u16,
                MASK => e.1 = ((mode >> 3) & 7) as u16,
                GROUP_OBJ if !has_mask => e.1 = ((mode >> 3) & 7) as u16,
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(entries: &[(u16, u16, u32)]) -> Acl {
        Acl(entries.to_vec())
    }

    #[test]
    fn round_trips_and_rejects_what_is_not_an_acl() {
        let a = acl(&[
            (USER_OBJ, 7, 0),
            (USER, 5, 1000),
            (GROUP_OBJ, 5, 0),
            (MASK, 5, 0),
            (OTHER, 0, 0),
        ]);
        assert_eq!(Acl::parse(&a.to_xattr()), Some(a.clone()));
        assert_eq!(a.mode(), (0o750, false));
        assert!(Acl::parse(b"\x01\0\0\0").is_none());
        assert!(Acl::parse(&[2, 0, 0, 0, 0x40, 0, 7, 0, 0, 0, 0, 0]).is_none());
        let minimal = acl(&[(USER_OBJ, 6, 0), (GROUP_OBJ, 4, 0), (OTHER, 4, 0)]);
        assert_eq!(minimal.mode(), (0o644, true));
    }

    /// The kernel's results: a default ACL `u::rwx,u:1000:rwx,g::r-x,
    /// m::rwx,o::r-x` on a directory, a file created with mode 0666 gets
    /// mask r-- ... as ext4 gives (`getfacl` of a new file).
    #[test]
    fn create_masq_matches_the_kernel() {
        let def = acl(&[
            (USER_OBJ, 7, 0),
            (USER, 7, 1000),
            (GROUP_OBJ, 5, 0),
            (MASK, 7, 0),
            (OTHER, 5, 0),
        ]);
        let mut f = def.clone();
        assert_eq!(f.create_masq(0o666), 0o664);
        assert_eq!(
            f,
            acl(&[
                (USER_OBJ, 6, 0),
                (USER, 7, 1000),
                (GROUP_OBJ, 5, 0),
                (MASK, 6, 0),
                (OTHER, 4, 0)
            ])
        );
        let mut d = def.clone();
        assert_eq!(d.create_masq(0o2777), 0o2775);
        // No mask: the group entry is limited instead.
        let mut g = acl(&[(USER_OBJ, 7, 0), (GROUP_OBJ, 7, 0), (OTHER, 7, 0)]);
        assert_eq!(g.create_masq(0o640), 0o640);
        assert_eq!(g.mode(), (0o640, true));
    }

    #[test]
    fn chmod_rewrites_owner_mask_and_other() {
        let mut a = acl(&[
            (USER_OBJ, 7, 0),
            (USER, 7, 1000),
            (GROUP_OBJ, 5, 0),
            (MASK, 7, 0),
            (OTHER, 5, 0),
        ]);
        a.chmod(0o640);
        assert_eq!(
            a,
            acl(&[
                (USER_OBJ, 6, 0),
                (USER, 7, 1000),
                (GROUP_OBJ, 5, 0),
                (MASK, 4, 0),
                (OTHER, 0, 0)
            ])
        );
        assert_eq!(a.mode(), (0o640, false));
        let mut b = acl(&[(USER_OBJ, 7, 0), (GROUP_OBJ, 5, 0), (OTHER, 5, 0)]);
        b.chmod(0o600);
        assert_eq!(b.mode(), (0o600, true));
    }
}
