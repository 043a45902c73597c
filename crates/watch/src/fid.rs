//! Decoding fanotify events of a group made with `FAN_REPORT_DFID_NAME`:
//! each event names a directory by file handle and an entry in it by name,
//! with no open descriptor. That is what lets a filesystem mark report
//! creations and renames (`FAN_CREATE`, `FAN_MOVED_TO`), not only writes.

/// `FAN_CLOSE_WRITE`, `FAN_MOVED_TO`, `FAN_CREATE`, `FAN_ONDIR`,
/// `FAN_Q_OVERFLOW`.
pub const CLOSE_WRITE: u64 = 0x08;
pub const MOVED_TO: u64 = 0x80;
pub const CREATE: u64 = 0x100;
pub const ONDIR: u64 = 0x4000_0000;
pub const Q_OVERFLOW: u64 = 0x4000;

/// Whether an event of `mask` names a change to dedupe: a creation of a
/// plain file alone is not one (its `close_write` follows), but fanotify
/// merges a queued creation and close_write of one name into one event,
/// which is (it was dropped: files made while a pass ran never deduped).
pub fn names_a_change(mask: u64) -> bool {
    let plain_create = mask & CREATE != 0 && mask & ONDIR == 0;
    !plain_create || mask & (CLOSE_WRITE | MOVED_TO) != 0
}

/// `struct fanotify_event_metadata`.
const METADATA: usize = 24;
/// `FAN_EVENT_INFO_TYPE_DFID_NAME`, `FAN_EVENT_INFO_TYPE_NEW_DFID_NAME`.
const INFO_DFID_NAME: u8 = 2;
const INFO_NEW_DFID_NAME: u8 = 12;
/// Info header (4) + fsid (8).
const HANDLE_AT: usize = 12;
/// `struct file_handle` header.
const HANDLE_HEADER: usize = 8;

/// One decoded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FidEvent {
    pub mask: u64,
    /// For a named event: the filesystem id, the directory's `struct
    /// file_handle` (header included) and the entry's name.
    pub named: Option<Named>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    pub fsid: [u8; 8],
    pub dir_handle: Vec<u8>,
    pub name: Vec<u8>,
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(
        b.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(
        b.get(at..at.checked_add(8)?)?.try_into().ok()?,
    ))
}

/// Decodes every whole event in `buf` (what one read(2) returned). Stops
/// at the first malformed one; what came before it is kept.
pub fn decode_events(buf: &[u8]) -> Vec<FidEvent> {
    let mut out = Vec::new();
    let mut pos = 0usize;
    while let Some((ev, len)) = decode_event(buf.get(pos..).unwrap_or_default()) {
        out.push(ev);
        pos += len;
    }
    out
}

/// One event at the start of `b` and its length.
fn decode_event(b: &[u8]) -> Option<(FidEvent, usize)> {
    let event_len = u32_at(b, 0)? as usize;
    let meta_len = u16_at(b, 6)? as usize;
    if event_len < METADATA || meta_len < METADATA || meta_len > event_len || event_len > b.len() {
        return None;
    }
    let mask = u64_at(b, 8)?;
    let mut named = None;
    let mut pos = meta_len;
    while pos + 4 <= event_len {
        let info_type = b[pos];
        let len = u16_at(b, pos + 2)? as usize;
        if len < 4 || pos + len > event_len {
            break;
        }
        let info = &b[pos..pos + len];
        if named.is_none() && (info_type == INFO_DFID_NAME || info_type == INFO_NEW_DFID_NAME) {
            named = decode_dfid_name(info);
        }
        pos += len;
    }
    Some((FidEvent { mask, named }, event_len))
}

/// A `fanotify_event_info_fid` record followed by a NUL-terminated name.
fn decode_dfid_name(info: &[u8]) -> Option<Named> {
    let fsid: [u8; 8] = info.get(4..12)?.try_into().ok()?;
    let bytes = u32_at(info, HANDLE_AT)? as usize;
    let handle_end = HANDLE_AT.checked_add(HANDLE_HEADER)?.checked_add(bytes)?;
    let dir_handle = info.get(HANDLE_AT..handle_end)?.to_vec();
    let rest = info.get(handle_end..)?;
    let name_len = rest.iter().position(|&c| c == 0)?;
    Some(Named {
        fsid,
        dir_handle,
        name: rest[..name_len].to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn event(mask: u64, handle: &[u8], name: &[u8]) -> Vec<u8> {
        let mut info = vec![INFO_DFID_NAME, 0, 0, 0];
        info.extend([7u8; 8]);
        info.extend((handle.len() as u32).to_ne_bytes());
        info.extend(1i32.to_ne_bytes());
        info.extend(handle);
        info.extend(name);
        info.push(0);
        while info.len() % 4 != 0 {
            info.push(0);
        }
        let il = info.len() as u16;
        info[2..4].copy_from_slice(&il.to_ne_bytes());
        let mut e = vec![0u8; METADATA];
        let el = (METADATA + info.len()) as u32;
        e[0..4].copy_from_slice(&el.to_ne_bytes());
        e[4] = 3;
        e[6..8].copy_from_slice(&(METADATA as u16).to_ne_bytes());
        e[8..16].copy_from_slice(&mask.to_ne_bytes());
        e[16..20].copy_from_slice(&(-1i32).to_ne_bytes());
        e.extend(info);
        e
    }

    #[test]
    fn decodes_two_events() {
        let mut b = event(CLOSE_WRITE, &[1, 2, 3, 4, 5, 6, 7, 8], b"copy0");
        b.extend(event(MOVED_TO | ONDIR, &[9; 12], b"dir"));
        let v = decode_events(&b);
        assert_eq!(v.len(), 2);
        let n = v[0].named.as_ref().unwrap();
        assert_eq!((n.name.as_slice(), n.fsid), (&b"copy0"[..], [7u8; 8]));
        assert_eq!(n.dir_handle.len(), 8 + 8);
        assert_eq!(v[1].mask, MOVED_TO | ONDIR);
        assert_eq!(v[1].named.as_ref().unwrap().name, b"dir");
        // A cut event is left out, the whole one before it kept.
        assert_eq!(decode_events(&b[..b.len() - 3]).len(), 1);
    }

    #[test]
    fn a_creation_merged_with_its_close_write_names_a_change() {
        assert!(!names_a_change(CREATE), "its close_write follows");
        assert!(names_a_change(CREATE | CLOSE_WRITE), "merged by fanotify");
        assert!(names_a_change(CREATE | MOVED_TO));
        assert!(names_a_change(CREATE | ONDIR), "a new directory");
        assert!(names_a_change(CLOSE_WRITE));
        assert!(names_a_change(MOVED_TO | ONDIR));
    }

    proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
            let v = decode_events(&bytes);
            prop_assert!(v.len() <= bytes.len() / METADATA);
        }

        #[test]
        fn roundtrips(evs in proptest::collection::vec(
            (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..40),
             proptest::collection::vec(1u8..=255, 0..60)), 0..8)) {
            let mut b = Vec::new();
            for (m, h, n) in &evs {
                b.extend(event(*m, h, n));
            }
            let v = decode_events(&b);
            prop_assert_eq!(v.len(), evs.len());
            for (e, (m, h, n)) in v.iter().zip(&evs) {
                prop_assert_eq!(e.mask, *m);
                let named = e.named.as_ref().unwrap();
                prop_assert_eq!(&named.name, n);
                prop_assert_eq!(named.dir_handle.len(), h.len() + 8);
            }
        }
    }
}
